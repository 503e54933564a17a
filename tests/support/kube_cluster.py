"""An emulated cluster for operator tests: API server, workload controllers, operator replicas.

`Cluster` bundles the emulated API server (kube_api.py), the Deployment
stand-in (kube_workloads.py) and any number of operator replicas, each a real
`tandem.operator.main.run` in its own thread and event loop, as kopf's own
KopfRunner does: kopf's shutdown cancels every task of its loop, so two
operators (or an operator and the API server) must not share one. Each
replica talks to the API through its own port, so the requests it made can be
told apart (`writes_by`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import kmock

from support.kube_api import (
    CHILDREN,
    EVENTS,
    MODELS,
    NAMESPACES,
    PEERINGS,
    PODS,
    ApiServer,
    Body,
)
from support.kube_workloads import DeploymentController
from tandem.operator import main
from tandem.operator.kube import Backoff
from tandem.operator.kube_connection import Connection
from tandem.operator.settings import OperatorSettings
from tandem.operator.sources import MetricSources

NAMESPACE = "default"
PEERING = "tandem-operator"
_WRITES = ("POST", "PATCH", "PUT", "DELETE")


class OperatorReplica:
    """One operator process, as a thread with its own loop."""

    def __init__(
        self,
        connection: Connection,
        settings: OperatorSettings,
        identity: str,
        sources: Callable[[], MetricSources],
        clock: Callable[[], float] = time.monotonic,
        port: int | None = None,
    ) -> None:
        self.port = port
        self.identity = identity
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.error: BaseException | None = None
        coro = main.run(
            settings,
            connection,
            sources=sources,
            identity=identity,
            clock=clock,
            backoff=Backoff(attempts=5, base_s=0.05, cap_s=0.5),
            tune=_quick,
            stop_flag=self._stop,
            ready_flag=self._ready,
        )
        self._thread = threading.Thread(target=self._main, args=(coro,), name=identity, daemon=True)

    def _main(self, coro: Any) -> None:
        try:
            asyncio.run(coro)
        except BaseException as error:  # reported by stop(): a test must not pass over it
            self.error = error

    async def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._ready.is_set():
            if self.error is not None or time.monotonic() > deadline:
                raise RuntimeError(f"operator {self.identity} did not start: {self.error!r}")
            await asyncio.sleep(0.01)

    def halt(self) -> None:
        """Stop a replica that did not start, whatever its run's error (the start's)."""
        self._stop.set()
        self._thread.join(15)

    async def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 15)
        if self._thread.is_alive():
            raise RuntimeError(f"operator {self.identity} did not stop")
        if self.error is not None:
            raise RuntimeError(f"operator {self.identity} failed") from self.error


def _quick(settings: Any) -> None:
    """kopf timings for tests: no multi-second waits anywhere."""
    settings.watching.reconnect_backoff = 0.05
    settings.queueing.idle_timeout = 1.0
    settings.queueing.exit_timeout = 1.0
    settings.background.cancellation_polling = 0.2
    settings.networking.error_backoffs = [0.05, 0.1, 0.2]


class Cluster:
    """The emulated API server with its controllers; operators join with `start_operator`."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self.workloads = DeploymentController(api)
        self.operators: list[OperatorReplica] = []
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Cluster:
        await self._stack.enter_async_context(self.api)
        await self._stack.enter_async_context(self.workloads)
        await self.api.create(NAMESPACES, None, {"metadata": {"name": NAMESPACE}})
        await self.api.create(PEERINGS, NAMESPACE, {"metadata": {"name": PEERING}})
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            for replica in reversed(self.operators):
                await replica.stop()
        finally:
            await self._stack.aclose()

    async def start_operator(
        self,
        sources: Callable[[], MetricSources],
        *,
        clock: Callable[[], float] = time.monotonic,
        **settings: Any,
    ) -> OperatorReplica:
        """A new operator replica on its own API port (settings: OperatorSettings fields)."""
        server = await self._stack.enter_async_context(kmock.Server(self.api))
        options = {
            "engine_image": "ghcr.io/tandem-serving/engine:0.1.0",
            "redis_url": "redis://tandem-redis.tandem-system.svc:6379/0",
            "namespaces": (NAMESPACE,),
            "peering_name": PEERING,
            "scrape_interval_s": 0.2,
            **settings,
        }
        replica = OperatorReplica(
            Connection(server=str(server.url)),
            OperatorSettings(**options),
            f"operator-{len(self.operators)}",
            sources,
            clock,
            port=server.port,
        )
        try:
            await replica.start()
        except RuntimeError:  # ended, or too slow to start: stopped now, not at the end
            await asyncio.to_thread(replica.halt)
            raise
        self.operators.append(replica)
        return replica

    # ------------------------------------------------------------------ objects

    async def apply(self, manifest: Mapping[str, Any], *, admit: bool = True) -> Body:
        body = {**manifest, "metadata": {**manifest["metadata"], "namespace": NAMESPACE}}
        return await self.api.create(MODELS, NAMESPACE, body, admit=admit)

    async def patch_model(self, name: str, patch: Mapping[str, Any], *, admit: bool = True) -> Body:
        return await self.api.patch(MODELS, NAMESPACE, name, patch, admit=admit)

    def model(self, name: str) -> Body | None:
        return self.api.read(MODELS, NAMESPACE, name)

    def child(self, kind: str, name: str) -> Body | None:
        return self.api.read(CHILDREN[kind], NAMESPACE, name)

    def children(self, model: str) -> list[Body]:
        """Every child of `model` (all four kinds), with kind and apiVersion as stored."""
        selector = f"app.kubernetes.io/instance={model}"
        return [
            obj
            for resource in CHILDREN.values()
            for obj in self.api.select(resource, NAMESPACE, selector)
        ]

    def pods(self, model: str, role: str) -> list[Body]:
        selector = f"app.kubernetes.io/instance={model},serving.tandem.dev/role={role}"
        return self.api.select(PODS, NAMESPACE, selector)

    def events(self, reason: str | None = None) -> list[Body]:
        return [e for e in self.api.select(EVENTS, NAMESPACE) if reason in (None, e["reason"])]

    def writes_by(self, replica: OperatorReplica, *, peering: bool = False) -> list[Any]:
        """Write requests the replica sent (without its peering keep-alives unless asked)."""
        return [
            request
            for request in self.api
            if request.url.port == replica.port
            and request.method.value in _WRITES
            and (peering or "kopfpeerings" not in request.url.path)
        ]


async def eventually(check: Callable[[], Any], *, timeout: float = 5.0, what: str = "") -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what or check}")
        await asyncio.sleep(0.02)


def normal_model(name: str = "m", **role: Any) -> dict[str, Any]:
    """A small Normal-mode ModelDeployment, `role` its normal role's fields."""
    return {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": {"path": "smollm2"}, "mode": "Normal", "normal": role},
    }
