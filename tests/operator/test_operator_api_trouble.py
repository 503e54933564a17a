"""What the operator does when the cluster gets in its way: a write the API server forbids,
an API server away for longer than one request's retries, a request queue it cannot read.
Each is said where `kubectl describe` shows it, and each heals at the next pass."""

from __future__ import annotations

import asyncio
import logging
from base64 import b64encode
from typing import Any

import pytest
from support.kube_api import CHILDREN, MODELS, PODS, SECRETS
from support.kube_cluster import NAMESPACE, eventually, normal_model

pytestmark = pytest.mark.asyncio


def status(cluster: Any) -> dict[str, Any]:
    return (cluster.model("m") or {}).get("status") or {}


def replicas(cluster: Any) -> int:
    return cluster.child("Deployment", "m-normal")["spec"]["replicas"]


async def test_a_forbidden_write_is_degraded_in_the_api_servers_words_until_it_passes(
    cluster, operator
):
    # A ResourceQuota on object counts answers 403 to the Service's create.
    quota = "services is forbidden: exceeded quota: objects, requested: services=1"
    cluster.api.fail_next(
        "POST", CHILDREN["Service"], status=403, reason="Forbidden", message=quota, times=10**6
    )
    await cluster.apply(normal_model())

    await eventually(lambda: status(cluster).get("phase") == "Degraded", what="Degraded")
    assert status(cluster)["reason"] == "Forbidden"
    assert "exceeded quota" in status(cluster)["message"]
    (event,) = await eventually(lambda: cluster.events("Forbidden"), what="an Event")
    assert event["type"] == "Warning"
    await asyncio.sleep(0.6)  # three more passes, each forbidden: said once
    assert len(cluster.events("Forbidden")) == 1

    cluster.api.clear_faults()  # the quota raised
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")
    assert cluster.child("Service", "m-normal") is not None
    # The children the quota held back are the spec's first creation, not a hand
    # deletion set back.
    assert not cluster.events("DriftRepaired")
    (applied,) = cluster.events("SpecApplied")
    assert "Service m-normal: created" in applied["message"]


async def test_the_autoscaler_resumes_at_its_next_tick_after_an_api_outage(
    cluster, operator, metrics, caplog
):
    caplog.set_level(logging.ERROR, logger="kopf.objects")
    metrics.default_kv = 0.3
    await cluster.apply(normal_model(minReplicas=1, maxReplicas=4))
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")

    # Longer than one request's retries: the autoscaler's pass fails.
    cluster.api.fail_next("GET", MODELS, "m", status=500, reason="InternalError", times=10**6)
    await eventually(
        lambda: any("Timer 'autoscale' failed" in r.getMessage() for r in caplog.records),
        timeout=20,
        what="a failed autoscaler pass",
    )
    cluster.api.clear_faults()
    metrics.default_kv = 1.0  # a scale-up at the next evaluation

    # kopf's default backoff would hold the timer for 60 s.
    await eventually(lambda: replicas(cluster) == 2, timeout=10, what="the scale-up")


async def test_a_pass_that_keeps_failing_is_one_warning_not_one_a_tick(cluster, operator):
    await cluster.apply(normal_model())
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")
    # The model is read, its pods are not: each pass fails after its retries.
    cluster.api.fail_next("GET", PODS, status=500, reason="InternalError", times=10**6)
    (event,) = await eventually(lambda: cluster.events("ReconcileFailed"), timeout=20)
    assert event["type"] == "Warning" and "500 InternalError" in event["message"]
    await asyncio.sleep(1.0)  # more failed passes: said once
    assert len(cluster.events("ReconcileFailed")) == 1


async def test_an_unreadable_queue_is_said_once_and_so_is_its_return(cluster, operator, metrics):
    model = normal_model(minReplicas=1, maxReplicas=4)
    url = b64encode(b"redis://:hunter2@redis.elsewhere:6379/0").decode()
    await cluster.api.create(SECRETS, NAMESPACE, {"metadata": {"name": "r"}, "data": {"url": url}})
    model["spec"]["redis"] = {"urlSecretRef": {"name": "r"}}
    await cluster.apply(model)
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")

    metrics.redis_down = True
    (event,) = await eventually(lambda: cluster.events("QueueUnreadable"), what="an Event")
    assert event["type"] == "Warning"
    assert "spec.redis" in event["message"] and "redis.elsewhere" in event["message"]
    assert "hunter2" not in event["message"]
    await asyncio.sleep(0.6)  # more failed reads: said once
    assert len(cluster.events("QueueUnreadable")) == 1

    metrics.redis_down = False
    await eventually(lambda: cluster.events("QueueReadable"), what="its return said")


@pytest.mark.parametrize("code, reason", [(403, "Forbidden"), (422, "Invalid")])
async def test_a_pod_refusing_its_deletion_cost_does_not_stop_a_scale_down(
    cluster, operator, metrics, code, reason
):
    # A policy protecting one pod refused its deletion-cost patch: the pass stopped
    # there, so the scale-down and every edit with it waited for good, the model Ready.
    await cluster.apply(normal_model(replicas=4, minReplicas=1, maxReplicas=6))
    await eventually(lambda: len(cluster.pods("m", "normal")) == 4, what="four pods")
    protected = sorted(p["metadata"]["name"] for p in cluster.pods("m", "normal"))[0]
    denied = f"admission webhook denied the request: pods/{protected} is protected"
    cluster.api.fail_next(
        "PATCH", PODS, protected, status=code, reason=reason, message=denied, times=10**6
    )
    edit = {"normal": {"replicas": None, "maxReplicas": 2}, "engine": {"maxNumSeqs": 64}}
    await cluster.patch_model("m", {"spec": edit})
    await eventually(lambda: replicas(cluster) == 2, what="clamped to maxReplicas")
    config = cluster.child("ConfigMap", "m-normal-engine")["data"]
    assert config["max-num-seqs"] == "64"  # the edit written with it
    model = cluster.model("m")
    await eventually(
        lambda: status(cluster).get("observedGeneration") == model["metadata"]["generation"],
        what="the edit observed",
    )
    assert not cluster.events("ReconcileFailed")


async def test_a_forbidden_delete_of_the_old_modes_children_is_degraded_until_it_passes(
    cluster, operator
):
    # After a mode change the old role's children go once the new roles serve; a
    # delete the API server forbade failed the pass for good, the status silent.
    await cluster.apply(normal_model())
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")
    forbidden = "deployments.apps is forbidden: a policy keeps m-normal"
    cluster.api.fail_next(
        "DELETE", CHILDREN["Deployment"], "m-normal", status=403, reason="Forbidden",
        message=forbidden, times=10**6,
    )  # fmt: skip
    split = {"mode": "Disaggregated", "normal": None, "prefill": {}, "decode": {}}
    await cluster.patch_model("m", {"spec": split})

    await eventually(lambda: status(cluster).get("reason") == "Forbidden", what="Forbidden")
    assert status(cluster)["phase"] == "Degraded"
    assert "a policy keeps m-normal" in status(cluster)["message"]
    cluster.api.clear_faults()
    await eventually(lambda: cluster.child("Deployment", "m-normal") is None, what="deleted")
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready, split")
