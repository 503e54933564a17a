"""`tandem operator`: run the operator with kopf, peering with its other replicas.

Peering: every replica registers in a kopf peering object (KopfPeering per
served namespace, or ClusterKopfPeering when cluster-wide) with its priority
and keeps it alive; a replica that sees a live peer of higher priority pauses
all its handlers until that peer is gone (it stops cleanly, or misses its
keep-alives for the peering lifetime, 60 s). So with one replica at priority
100 and one at 0, the second is a hot standby that never writes while the
first lives. The peering object must exist (the Helm chart creates it).

`run` is what both `tandem operator` and the tests execute, so the tests
exercise the same wiring with a test API server and fake metric sources.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from tandem.listen import every_interface_url
from tandem.operator.controller import Controller
from tandem.operator.handlers import build_registry, configure
from tandem.operator.kube import Backoff, KubeApi
from tandem.operator.kube_connection import Connection
from tandem.operator.settings import OperatorSettings, from_args
from tandem.operator.sources import MetricSources, close_sources, production_sources
from tandem.operator.start_checks import CannotServe, check_crd, check_peerings

log = logging.getLogger(__name__)


async def run(
    settings: OperatorSettings,
    connection: Connection,
    *,
    sources: Callable[[], MetricSources] | None = None,
    identity: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    backoff: Backoff | None = None,
    tune: Callable[[kopf.OperatorSettings], None] | None = None,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
) -> None:
    """Run the operator until `stop_flag` is set (or SIGINT/SIGTERM in the main thread).

    `sources` makes the autoscaler's inputs inside the running loop (default:
    HTTP scraping and Redis); `tune` adjusts kopf's settings (tests shorten
    timeouts). `identity` names this replica among its peers.
    """
    kube = KubeApi(connection, backoff=backoff or Backoff(), instance=identity or "")
    metric_sources = (
        sources()
        if sources is not None
        else production_sources(settings.key_prefix, settings.scrape_timeout_s)
    )
    controller = Controller(kube, metric_sources, settings, clock=clock)

    def login(**_: Any) -> kopf.ConnectionInfo:
        return _connection_info(connection, settings)

    async def cleanup() -> None:
        await kube.aclose()
        await close_sources(metric_sources)

    await check_peerings(kube, settings)
    await check_crd(kube)
    registry = build_registry(controller, settings, login, cleanup)
    kopf_settings = kopf.OperatorSettings()
    configure(kopf_settings, settings)
    if tune is not None:
        tune(kopf_settings)
    await kopf.operator(
        registry=registry,
        settings=kopf_settings,
        clusterwide=settings.clusterwide,
        namespaces=list(settings.namespaces),
        standalone=settings.standalone,
        peering_name=None if settings.standalone else settings.peering_name,
        priority=settings.priority,
        # 0.0.0.0 is "::" in a pod of an IPv6 cluster (tandem/listen.py).
        liveness_endpoint=settings.liveness_endpoint
        and every_interface_url(settings.liveness_endpoint),
        identity=identity,  # type: ignore[arg-type]  # kopf.Identity is a NewType of str
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


def _connection_info(connection: Connection, settings: OperatorSettings) -> kopf.ConnectionInfo:
    """kopf's view of the same credentials (asked again by kopf after a 401)."""
    connection.refresh()
    scheme, token = connection.token
    return kopf.ConnectionInfo(
        server=connection.server,
        ca_path=connection.ca_path,
        insecure=connection.insecure,
        scheme=scheme,
        token=token,
        certificate_path=connection.cert_path,
        private_key_path=connection.key_path,
        # Where kopf posts Events about cluster-scoped objects (we have none).
        default_namespace=settings.namespaces[0] if settings.namespaces else None,
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `tandem operator` (flags: settings.add_arguments)."""
    settings = from_args(args)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "verbose", False):
        # One line per request and per handler run (a timer per model every 15 s) is noise;
        # the Controller logs what it changes, kopf its warnings and errors.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # A line per liveness and readiness probe (kopf's health server is aiohttp's).
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        connection = Connection.discover()
    except RuntimeError as error:
        print(f"tandem operator: {error}", file=sys.stderr)
        return 2
    scope = ", ".join(settings.namespaces) or "all namespaces"
    log.info("serving ModelDeployments in %s against %s", scope, connection.server)
    try:
        asyncio.run(run(settings, connection, identity=own_identity(os.environ)))
    except CannotServe as error:
        print(f"tandem operator: {error}", file=sys.stderr)
        return 2
    return 0


def own_identity(environ: Mapping[str, str]) -> str:
    """This replica's name among its peers (kopf's peering, Events' reportingInstance):
    its pod's (POD_ID, as kopf reads it, or the chart's POD_NAME), else the host's with
    a random suffix. Not kopf's own default, which asks the password database for the
    user: a runAsUser the image does not list (OpenShift picks one) ended the operator."""
    name = environ.get("POD_ID") or environ.get("POD_NAME")
    return name or f"{socket.gethostname()}-{secrets.token_hex(4)}"
