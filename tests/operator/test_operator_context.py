"""What outside its spec changes a model: the operator's own settings, and the other
ModelDeployments of its namespace. Against the emulated API, as test_operator.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from support.kube_cluster import eventually

from tandem.operator.sources import MetricSources

pytestmark = pytest.mark.asyncio


def normal(name: str, served: str | None = None) -> dict[str, Any]:
    source = {"path": "smollm2", **({"servedModelName": served} if served else {})}
    return {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name},
        "spec": {"model": source, "mode": "Normal", "normal": {"maxReplicas": 4}},
    }


def status(cluster: Any, name: str) -> dict[str, Any]:
    return (cluster.model(name) or {}).get("status") or {}


def pod_names(cluster: Any, name: str) -> set[str]:
    return {p["metadata"]["name"] for p in cluster.pods(name, "normal")}


async def restarted_with(cluster: Any, metrics: Any, clock: Any, old: dict, new: dict) -> None:
    """Model m Ready under an operator with settings `old`, then one with `new` instead,
    until every pod of m is replaced."""

    def sources() -> MetricSources:
        return MetricSources(metrics, metrics)

    first = await cluster.start_operator(sources, clock=clock, **old)
    await cluster.apply(normal("m"))
    await eventually(lambda: status(cluster, "m").get("phase") == "Ready", what="Ready")
    before = pod_names(cluster, "m")
    await first.stop()
    await cluster.start_operator(sources, clock=clock, **new)
    await eventually(lambda: pod_names(cluster, "m").isdisjoint(before), what="every pod replaced")


async def test_a_new_redis_url_of_the_operator_rolls_the_engine_pods(cluster, metrics, clock):
    url = "redis://:rotated@r:6379/0"  # a password rotation
    old = {"redis_url": "redis://:old@r:6379/0"}
    await restarted_with(cluster, metrics, clock, old, {"redis_url": url})

    secret = cluster.child("Secret", "m-normal-redis")
    assert base64.b64decode(secret["data"]["url"]).decode() == url
    template = json.dumps(cluster.child("Deployment", "m-normal")["spec"]["template"])
    assert "rotated" not in template and base64.b64encode(url.encode()).decode() not in template
    (event,) = await eventually(lambda: cluster.events("SettingsApplied"), what="an Event")
    assert event["message"].startswith("the operator's --redis-url changed")
    assert cluster.events("DriftRepaired") == [], "not a hand edit"


async def test_an_operator_upgrade_with_a_new_engine_image_rolls_the_pods(cluster, metrics, clock):
    old, new = {"engine_image": "engine:1"}, {"engine_image": "engine:2"}
    await restarted_with(cluster, metrics, clock, old, new)

    images = {c["image"] for p in cluster.pods("m", "normal") for c in p["spec"]["containers"]}
    assert images == {"engine:2"}
    (event,) = await eventually(lambda: cluster.events("SettingsApplied"), what="an Event")
    assert event["message"].startswith("the operator's --engine-image changed")
    assert cluster.events("DriftRepaired") == [], "not a hand edit"


async def test_a_served_name_is_served_by_the_older_model_alone(cluster, operator, metrics):
    await cluster.apply(normal("a", served="shared"))
    await cluster.apply(normal("b", served="shared"))

    await eventually(lambda: status(cluster, "b").get("phase") == "Invalid", what="b Invalid")
    assert status(cluster, "b")["reason"] == "ServedNameTaken"
    # Claimed by a (older) as b first looks, served by it soon after.
    assert "by ModelDeployment a: " in status(cluster, "b")["message"]
    (warning,) = await eventually(lambda: cluster.events("ServedNameTaken"), what="a Warning")
    assert warning["type"] == "Warning" and warning["involvedObject"]["name"] == "b"
    await eventually(lambda: status(cluster, "a").get("phase") == "Ready", what="a serves")
    assert cluster.children("b") == [], "nothing of b's created"
    # Only the older one reads the name's queue and declares it in the catalog.
    await eventually(lambda: len(metrics.declarations) >= 3, what="a few autoscaler ticks")
    assert _declared(metrics) == {("shared", "default/a")}

    await cluster.patch_model("a", {"spec": {"model": {"servedModelName": "a-only"}}})
    await eventually(lambda: status(cluster, "b").get("phase") == "Ready", what="b serves now")
    # a's pods roll to take the new name (it names its queue), then a serves again.
    await eventually(lambda: status(cluster, "a").get("phase") == "Ready", what="a serves a-only")
    await eventually(lambda: ("shared", "default/b") in _declared(metrics), what="b declared")
    await eventually(lambda: ("a-only", "default/a") in _declared(metrics), what="a declared anew")


@pytest.mark.parametrize("ran_before", [False, True])
async def test_a_model_the_name_is_freed_for_starts_at_its_replicas(cluster, operator, ran_before):
    # Its own spec.normal.replicas: "pods to start with", not the zero it was held at
    # (which clamped to minReplicas, 1).
    b = normal("b", served="b-own" if ran_before else "shared")
    b["spec"]["normal"]["replicas"] = 2
    await cluster.apply(normal("a", served="shared"))
    await cluster.apply(b)
    if ran_before:  # then renamed onto a's name: its pods serve the old one meanwhile
        await eventually(lambda: len(cluster.pods("b", "normal")) == 2, what="b serves")
        await cluster.patch_model("b", {"spec": {"model": {"servedModelName": "shared"}}})
    await eventually(lambda: status(cluster, "b").get("reason") == "ServedNameTaken")
    if ran_before:
        assert len(cluster.pods("b", "normal")) == 2
        assert "its pods serve 'b-own' meanwhile" in status(cluster, "b")["message"]
    else:
        await eventually(lambda: cluster.pods("b", "normal") == [], what="b serves nothing")

    await cluster.patch_model("a", {"spec": {"model": {"servedModelName": "a-only"}}})
    await eventually(lambda: status(cluster, "b").get("phase") == "Ready", what="b serves now")
    assert cluster.child("Deployment", "b-normal")["spec"]["replicas"] == 2
    assert len(cluster.pods("b", "normal")) == 2


async def test_an_edit_onto_a_served_name_leaves_both_models_serving(cluster, operator):
    # The older model edited onto the younger's name (a typo, a copy-paste): the oldest
    # claimant held it, so the younger, serving model went to zero pods, and the older
    # one's own name was served by nobody. Now a rename or mode change that is refused
    # leaves the pods as an invalid edit does.
    await cluster.apply(normal("a", served="llama"))
    await cluster.apply(normal("b", served="mistral"))
    await eventually(lambda: status(cluster, "b").get("phase") == "Ready", what="b serves")
    await eventually(lambda: status(cluster, "a").get("phase") == "Ready", what="a serves")
    serving = {name: pod_names(cluster, name) for name in ("a", "b")}

    split = {"mode": "Disaggregated", "normal": None, "prefill": {}, "decode": {}}
    await cluster.patch_model("a", {"spec": {"model": {"servedModelName": "mistral"}, **split}})
    await eventually(lambda: status(cluster, "a").get("reason") == "ServedNameTaken", what="taken")
    assert "served by ModelDeployment b" in status(cluster, "a")["message"]
    assert status(cluster, "b")["phase"] == "Ready"
    assert {name: pod_names(cluster, name) for name in ("a", "b")} == serving
    assert cluster.child("Deployment", "b-normal")["spec"]["replicas"] == 1
    args = cluster.child("Deployment", "a-normal")["spec"]["template"]["spec"]["containers"][0]
    assert "--served-model-name=llama" in args["args"]


def _declared(metrics: Any) -> set[tuple[str, str]]:
    """(served name, owner) of every catalog declaration so far."""
    return {(model, owner) for _, model, owner in metrics.declarations}
