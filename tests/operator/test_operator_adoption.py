"""A child's name already taken when the operator creates it: adopted when an earlier
ModelDeployment of the same name left it behind, else reported, never a silent loop."""

from __future__ import annotations

from typing import Any

import pytest
from support.kube_api import CHILDREN, DEPLOYMENTS, MODELS
from support.kube_cluster import NAMESPACE, eventually

pytestmark = pytest.mark.asyncio

MODEL = {
    "apiVersion": "serving.tandem.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "m"},
    "spec": {"model": {"path": "smollm2"}, "mode": "Normal", "normal": {"replicas": 1}},
}


def squatter(owner: dict[str, Any]) -> dict[str, Any]:
    """A Deployment named as m's normal role, owned by `owner`."""
    labels = {"app": "x"}
    return {
        "metadata": {"name": "m-normal", "labels": labels, "ownerReferences": [owner]},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]},
            },
        },
    }


def status(cluster: Any) -> dict[str, Any]:
    return (cluster.model("m") or {}).get("status") or {}


async def test_a_name_another_controller_holds_is_reported_until_freed(cluster, operator):
    other = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "foo", "uid": "u-1"}
    await cluster.api.create(DEPLOYMENTS, NAMESPACE, squatter({**other, "controller": True}))
    await cluster.apply(MODEL)

    await eventually(lambda: status(cluster).get("reason") == "ChildTaken", what="ChildTaken")
    assert status(cluster)["phase"] == "Invalid"
    assert "Deployment m-normal exists and belongs to ReplicaSet foo" in status(cluster)["message"]
    (event,) = await eventually(lambda: cluster.events("ChildTaken"), what="a Warning")
    assert event["type"] == "Warning"
    assert cluster.pods("m", "normal") == []

    await cluster.api.delete(DEPLOYMENTS, NAMESPACE, "m-normal")
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready once freed")


async def test_a_name_taken_last_leaves_the_other_children_unmade(cluster, operator):
    # The PodDisruptionBudget comes after the Deployment: the dry run passed the taken
    # name, the real writes made the Secret, ConfigMap, Service and Deployment, and the
    # model, Invalid from then on, ran pods that nothing scaled or repaired.
    other = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x", "uid": "u-2"}
    budget = {
        "metadata": {"name": "m-normal", "ownerReferences": [{**other, "controller": True}]},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "x"}}},
    }
    await cluster.api.create(CHILDREN["PodDisruptionBudget"], NAMESPACE, budget)
    await cluster.apply(MODEL)

    await eventually(lambda: status(cluster).get("reason") == "ChildTaken", what="ChildTaken")
    assert (
        "PodDisruptionBudget m-normal exists and belongs to Deployment x"
        in (status(cluster)["message"])
    )
    assert cluster.children("m") == [] and cluster.pods("m", "normal") == []

    await cluster.api.delete(CHILDREN["PodDisruptionBudget"], NAMESPACE, "m-normal")
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready once freed")


async def test_what_an_earlier_model_of_the_same_name_left_is_adopted(cluster, operator):
    earlier = {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "name": "m",
        "uid": "an-earlier-uid",
        "controller": True,
    }
    await cluster.api.create(DEPLOYMENTS, NAMESPACE, squatter(earlier))
    await cluster.apply(MODEL)

    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")
    (owner,) = cluster.child("Deployment", "m-normal")["metadata"]["ownerReferences"]
    assert owner["uid"] == cluster.model("m")["metadata"]["uid"]
    assert cluster.events("ChildTaken") == []
    # Taken over on the model's first pass, whose creations are no news: said all the same.
    (event,) = await eventually(lambda: cluster.events("DriftRepaired"), what="DriftRepaired")
    assert event["message"] == "Deployment m-normal: adopted"


async def test_a_child_that_lost_its_labels_is_said_to_be_adopted(cluster, operator):
    await cluster.apply(MODEL)
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")
    uid = cluster.child("Deployment", "m-normal")["metadata"]["uid"]

    # Out of the operator's label selector, the Deployment looks gone; creating it
    # again finds it there.
    patch = {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}}
    await cluster.api.patch(DEPLOYMENTS, NAMESPACE, "m-normal", patch)

    (event,) = await eventually(lambda: cluster.events("DriftRepaired"), what="DriftRepaired")
    assert event["message"] == "Deployment m-normal: adopted"
    child = cluster.child("Deployment", "m-normal")
    assert child["metadata"]["uid"] == uid, "the same object, not a new one"
    assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tandem-operator"


async def test_an_object_of_a_childs_name_that_is_nobodys_child_is_not_taken_over(
    cluster, operator
):
    # A team's own Service, made by kubectl or Helm (no owner, none of the model's
    # labels): it was adopted in silence, its selector merged with the engines' (so it
    # matched neither), and deleted with the model.
    service = {
        "metadata": {"name": "m-normal", "labels": {"app": "legacy"}},
        "spec": {"selector": {"app": "legacy"}, "ports": [{"port": 80}]},
    }
    await cluster.api.create(CHILDREN["Service"], NAMESPACE, service)
    await cluster.apply(MODEL)

    await eventually(lambda: status(cluster).get("reason") == "ChildTaken", what="ChildTaken")
    assert "Service m-normal exists and is not this ModelDeployment's" in status(cluster)["message"]
    theirs = cluster.api.read(CHILDREN["Service"], NAMESPACE, "m-normal")
    assert theirs["spec"]["selector"] == {"app": "legacy"}
    assert not theirs["metadata"].get("ownerReferences")

    await cluster.api.delete(CHILDREN["Service"], NAMESPACE, "m-normal")
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready once freed")


async def test_an_orphaned_child_with_the_models_labels_is_adopted(cluster, operator):
    # `kubectl delete modeldeployment m --cascade=orphan`, then m again: its children
    # lost their owner references, not their labels.
    await cluster.apply(MODEL)
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")
    uid = cluster.child("Service", "m-normal")["metadata"]["uid"]
    patch = {
        "metadata": {
            "ownerReferences": None,
            "labels": {"app.kubernetes.io/managed-by": None},
        }
    }
    await cluster.api.patch(CHILDREN["Service"], NAMESPACE, "m-normal", patch)

    (event,) = await eventually(lambda: cluster.events("DriftRepaired"), what="DriftRepaired")
    assert event["message"] == "Service m-normal: adopted"
    child = cluster.child("Service", "m-normal")
    assert child["metadata"]["uid"] == uid
    assert child["metadata"]["ownerReferences"][0]["uid"] == cluster.model("m")["metadata"]["uid"]


async def test_children_orphaned_with_their_labels_are_said_to_be_adopted_by_a_new_model(
    cluster, operator
):
    # `kubectl delete md m --cascade=orphan` keeps every label: the new m's selector
    # finds the children and its first pass takes them over, which no Event said.
    await cluster.apply(MODEL)
    await eventually(lambda: status(cluster).get("phase") == "Ready", what="Ready")
    children = {(c["kind"], c["metadata"]["name"]): c for c in cluster.children("m")}
    for kind, name in children:
        orphaned = {"metadata": {"ownerReferences": None}}
        await cluster.api.patch(CHILDREN[kind], NAMESPACE, name, orphaned)
    await cluster.api.delete(MODELS, NAMESPACE, "m")
    await eventually(lambda: cluster.model("m") is None, what="m deleted")

    await cluster.apply(MODEL)
    uid = cluster.model("m")["metadata"]["uid"]

    def repaired() -> list[dict]:  # the new m's (the old one set its children back too)
        return [e for e in cluster.events("DriftRepaired") if e["involvedObject"]["uid"] == uid]

    (event,) = await eventually(repaired, what="the new model's DriftRepaired")
    said = sorted(event["message"].split("; "))
    assert said == sorted(f"{kind} {name}: adopted" for kind, name in children)
    for (kind, name), before in children.items():
        child = cluster.child(kind, name)
        assert child["metadata"]["uid"] == before["metadata"]["uid"], "the same object"
        assert [ref["uid"] for ref in child["metadata"]["ownerReferences"]] == [uid]
