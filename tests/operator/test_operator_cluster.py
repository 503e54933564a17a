"""Smoke test against a real cluster: run when KUBECONFIG is set, skipped otherwise.

Needs the CRD (`kubectl apply -f crds/modeldeployment.yaml`) and rights to
create ModelDeployments and their children in TANDEM_TEST_NAMESPACE
(default: default). The operator runs here, standalone (no peering object
needed), with fake engine metrics: the pods need not start for the children
to exist.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import pytest
import yaml
from support.kube_cluster import OperatorReplica

from tandem.operator.kube import ApiError, KubeApi
from tandem.operator.kube_connection import Connection
from tandem.operator.settings import OperatorSettings
from tandem.operator.sources import MetricSources

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("ConfigMap", "Service", "Deployment", "PodDisruptionBudget")

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG"),
        reason="no KUBECONFIG: the real-cluster smoke test runs only against a cluster",
    ),
    pytest.mark.asyncio,
    pytest.mark.slow,
]


async def test_an_example_gets_its_children_on_a_real_cluster(metrics):
    namespace = os.environ.get("TANDEM_TEST_NAMESPACE", "default")
    connection = Connection.discover()
    kube = KubeApi(connection)
    manifest = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    name = f"smoke-{uuid.uuid4().hex[:6]}"
    manifest["metadata"] = {"name": name, "namespace": namespace}
    settings = OperatorSettings(namespaces=(namespace,), standalone=True, scrape_interval_s=5)
    replica = OperatorReplica(
        connection, settings, "smoke", lambda: MetricSources(metrics, metrics)
    )
    await replica.start()
    try:
        try:
            await kube.create(manifest)
        except ApiError as error:
            if error.status not in (403, 404):  # a refused manifest is a failure
                raise
            # The CRD is not installed, or this user may not create one: said, not failed.
            pytest.skip(f"cannot create a ModelDeployment in {namespace}: {error}")
        labels = {"app.kubernetes.io/instance": name}
        deadline = time.monotonic() + 60
        while True:
            found = [c for kind in KINDS for c in await kube.list(kind, namespace, labels)]
            model = await kube.get("ModelDeployment", namespace, name) or {}
            observed = (model.get("status") or {}).get("observedGeneration")
            if (len(found) == len(KINDS) and observed) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        assert sorted(c["kind"] for c in found) == sorted(KINDS)
        assert observed == 1
    finally:
        await kube.delete("ModelDeployment", namespace, name)
        await kube.aclose()
        await replica.stop()
