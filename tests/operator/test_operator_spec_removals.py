"""A setting removed from the spec leaves the pods too: a merge patch only adds keys, so
the operator nulls the keys of the maps it owns whole (nodeSelector, affinity, the
engine's resources) that its manifest once set, and writes the image pull policy out."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support.kube_api import DEPLOYMENTS
from support.kube_cluster import NAMESPACE, eventually, normal_model

pytestmark = pytest.mark.asyncio

ANTI_AFFINITY = {
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {
            "weight": 1,
            "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {"app": "m"}},
            },
        }
    ]
}
NODE_AFFINITY = {
    "requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}
        ]
    }
}


def observed(cluster: Any) -> int | None:
    return ((cluster.model("m") or {}).get("status") or {}).get("observedGeneration")


def pod_spec(cluster: Any) -> dict[str, Any]:
    return cluster.child("Deployment", "m-normal")["spec"]["template"]["spec"]


async def test_keys_removed_from_owned_maps_leave_the_deployment(cluster, operator):
    await cluster.apply(
        normal_model(
            resources={"limits": {"cpu": "2", "memory": "4Gi"}},
            nodeSelector={"pool": "gpu", "zone": "a"},
            affinity={"nodeAffinity": NODE_AFFINITY, "podAntiAffinity": ANTI_AFFINITY},
        )
    )
    await eventually(lambda: observed(cluster) == 1, what="the first pass")
    removal = {
        "resources": {"limits": {"memory": None}},
        "nodeSelector": {"zone": None},
        "affinity": {"podAntiAffinity": None},
    }
    await cluster.patch_model("m", {"spec": {"normal": removal}})

    def removed() -> bool:
        pod = pod_spec(cluster)
        return (
            pod["containers"][0]["resources"]["limits"] == {"cpu": "2"}
            and pod["nodeSelector"] == {"pool": "gpu"}
            and pod["affinity"] == {"nodeAffinity": NODE_AFFINITY}
        )

    await eventually(removed, what="the memory limit, zone label and anti-affinity gone")


async def test_a_removed_pull_policy_falls_back_to_the_images_default(cluster, operator):
    model = normal_model()
    model["spec"]["image"] = "example.com/tandem-engine:1.0"
    model["spec"]["imagePullPolicy"] = "Never"
    await cluster.apply(model)
    await eventually(lambda: observed(cluster) == 1, what="the first pass")
    assert pod_spec(cluster)["containers"][0]["imagePullPolicy"] == "Never"

    await cluster.patch_model("m", {"spec": {"imagePullPolicy": None}})
    await eventually(
        lambda: pod_spec(cluster)["containers"][0]["imagePullPolicy"] == "IfNotPresent",
        what="the image's default pull policy",
    )


async def test_a_key_someone_else_added_stays(cluster, operator):
    # A mutating webhook's default (a label, a request): removed on every pass, it
    # would be put back on every pass. Only keys the spec once set are the operator's.
    await cluster.apply(
        normal_model(nodeSelector={"pool": "gpu"}, resources={"limits": {"memory": "4Gi"}})
    )
    await eventually(lambda: observed(cluster) == 1, what="the first pass")
    pod = pod_spec(cluster)
    containers = pod["containers"]
    containers[0]["resources"]["requests"] = {"memory": "1Gi"}
    selector = {**pod["nodeSelector"], "zone": "webhook"}
    patch = {"spec": {"template": {"spec": {"containers": containers, "nodeSelector": selector}}}}
    await cluster.api.patch(DEPLOYMENTS, NAMESPACE, "m-normal", patch)
    await asyncio.sleep(0.6)  # a few timer passes

    pod = pod_spec(cluster)
    assert pod["nodeSelector"] == {"pool": "gpu", "zone": "webhook"}
    assert pod["containers"][0]["resources"]["requests"] == {"memory": "1Gi"}
    assert not cluster.events("DriftRepaired")
