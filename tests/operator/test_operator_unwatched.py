"""A stretch the autoscaler did not watch never counts as idle time after it.

Redis unreadable, a spec Invalid, a served name held by an older model: the pods
serve on, unobserved. At the first quiet evaluation after, a model allowed to scale
to zero must not be emptied for an "idle" time it never saw; nor may a role that
comes back after a mode change inherit the idle clock of the role it replaces.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.kube_cluster import eventually

pytestmark = pytest.mark.asyncio

TO_ZERO = {"replicas": 2, "minReplicas": 0, "maxReplicas": 3, "scaleToZeroAfterSeconds": 60}


def model(mode: str = "Normal", **roles: Any) -> dict[str, Any]:
    return {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m"},
        "spec": {"model": {"path": "smollm2"}, "mode": mode, **roles},
    }


def replicas(cluster: Any, role: str = "normal") -> int | None:
    child = cluster.child("Deployment", f"m-{role}")
    return child and child["spec"]["replicas"]


def phase(cluster: Any, name: str = "m") -> str | None:
    return ((cluster.model(name) or {}).get("status") or {}).get("phase")


async def evaluations(metrics: Any, running: int) -> None:
    """Wait for a few autoscaler evaluations with `running` requests on each pod."""
    metrics.running = running
    reads = len(metrics.queue_reads)
    await eventually(lambda: len(metrics.queue_reads) >= reads + 3, what="evaluations")


async def test_a_redis_outage_is_not_idle_time(cluster, operator, metrics, clock):
    await cluster.apply(model(normal=TO_ZERO))
    await eventually(lambda: phase(cluster) == "Ready", what="Ready")
    await evaluations(metrics, running=4)  # busy, and watched
    metrics.redis_down = True  # busy pods, but the queue cannot be read
    await asyncio.sleep(0.5)
    clock.advance(600)
    await asyncio.sleep(0.5)
    metrics.redis_down = False
    await evaluations(metrics, running=0)
    assert replicas(cluster) == 2, "scaled to zero for an outage it did not watch"
    clock.advance(61)  # a whole idle period it did watch
    await eventually(lambda: replicas(cluster) == 0, what="scaled to zero after watching")


async def test_an_invalid_stretch_is_not_idle_time(cluster, operator, metrics, clock):
    await cluster.apply(model(normal=TO_ZERO))
    await eventually(lambda: phase(cluster) == "Ready", what="Ready")
    await evaluations(metrics, running=4)
    await cluster.patch_model("m", {"spec": {"normal": {"replicas": 5}}}, admit=False)
    await eventually(lambda: phase(cluster) == "Invalid", what="Invalid")
    clock.advance(600)
    await asyncio.sleep(0.5)
    await cluster.patch_model("m", {"spec": {"normal": {"replicas": None}}})
    await eventually(lambda: phase(cluster) == "Ready", what="Ready again")
    await evaluations(metrics, running=0)
    assert replicas(cluster) == 2, "scaled to zero for the time it was Invalid"


async def test_a_role_back_after_a_mode_change_starts_its_own_idle_clock(
    cluster, operator, metrics, clock
):
    await cluster.apply(model(normal={**TO_ZERO, "replicas": 1}))
    await eventually(lambda: phase(cluster) == "Ready", what="Ready")
    await evaluations(metrics, running=0)  # the normal role's history: idle from now on
    split = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    await cluster.patch_model("m", {"spec": {"mode": "Disaggregated", "normal": None, **split}})
    await eventually(lambda: replicas(cluster, "prefill") == 1, what="Disaggregated")
    clock.advance(120)
    await asyncio.sleep(0.3)
    back = {"prefill": None, "decode": None, "normal": {**TO_ZERO, "replicas": 1}}
    await cluster.patch_model("m", {"spec": {"mode": "Normal", **back}})
    await eventually(lambda: replicas(cluster) is not None, what="normal again")
    await evaluations(metrics, running=0)
    assert replicas(cluster) == 1, "the new normal role inherited the old one's idle clock"
