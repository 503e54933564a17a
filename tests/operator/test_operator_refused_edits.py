"""An edit the API server refuses changes no child: every write is checked (dryRun=All)
before any is made, so a model never runs half the old spec and half the new."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.kube_cluster import eventually

pytestmark = pytest.mark.asyncio


def split() -> dict[str, Any]:
    return {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m"},
        "spec": {
            "model": {"path": "smollm2"},
            "mode": "Disaggregated",
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1},
        },
    }


def phase(cluster: Any) -> str | None:
    return ((cluster.model("m") or {}).get("status") or {}).get("phase")


def block_size(cluster: Any, kind: str, role: str) -> list[str]:
    if kind == "Deployment":
        container = cluster.child(kind, f"m-{role}")["spec"]["template"]["spec"]["containers"][0]
        return [a for a in container["args"] if a.startswith("--block-size")]
    return [cluster.child(kind, f"m-{role}-engine")["data"].get("block-size")]


async def test_an_edit_refused_for_one_role_leaves_both_as_they_were(cluster, operator):
    await cluster.apply(split())
    await eventually(lambda: phase(cluster) == "Ready", what="Ready")
    before = {
        (k, r): block_size(cluster, k, r)
        for k in ("Deployment", "ConfigMap")
        for r in ("prefill", "decode")
    }
    typo = {"nodeAfinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    edit = {"engine": {"blockSize": 32}, "decode": {"affinity": typo}}
    await cluster.patch_model("m", {"spec": edit})

    await eventually(lambda: phase(cluster) == "Invalid", what="Invalid")
    await asyncio.sleep(0.5)  # a few more passes: still nothing written
    after = {key: block_size(cluster, *key) for key in before}
    assert after == before, "a role rolled to the refused spec"
