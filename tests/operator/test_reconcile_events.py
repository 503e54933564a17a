"""What a pass reports and why: counts a bound moves, hand scales, the operator's own
settings, and a served name another model holds. Pure, as test_reconcile.py."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from tandem.operator.autoscaler import Decision, ScalingHistory
from tandem.operator.events import Event
from tandem.operator.manifests import DEFAULTS_ANNOTATION, OperatorDefaults
from tandem.operator.reconcile import plan
from tandem.operator.role_name import RoleName
from tandem.operator.served_names import queues_digest, served_name_holder

NOW = "2026-01-01T00:00:00Z"
# The operator's Redis as the chart names it.
SHARED = "redis://:secret@tandem-redis.tandem.svc:6379/0"
OLD = OperatorDefaults(image="engine:1", redis_url="redis://:old-password@r:6379/0")
NEW = OperatorDefaults(image="engine:1", redis_url="redis://:new-password@r:6379/0")


def running(role: dict[str, Any], *, desired: int, generation: int = 1) -> dict[str, Any]:
    """A Normal model whose last pass (generation 1) reported `desired` pods."""
    return {
        "metadata": {"name": "m", "namespace": "ns", "uid": "u-1", "generation": generation},
        "spec": {"model": {"path": "smollm2"}, "mode": "Normal", "normal": role},
        "status": {
            "observedGeneration": 1,
            "phase": "Ready",
            "roles": {"normal": {"desired": desired}},
        },
    }


def built(body: dict[str, Any], defaults: OperatorDefaults = OLD) -> list[dict[str, Any]]:
    """The children as the operator made them."""
    return [copy.deepcopy(c) for c in plan(body, [], defaults, now=NOW).creates]


def child(children: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(c for c in children if c["kind"] == kind)


def test_a_new_redis_url_rolls_the_pods_and_is_reported_as_the_operators_setting():
    body = running({}, desired=1)
    children = built(body, OLD)

    actions = plan(body, children, NEW, now=NOW)
    patched = {p.kind: p for p in actions.patches}
    assert set(patched) == {"Secret", "Deployment"}
    template = patched["Deployment"].patch["spec"]["template"]
    old_template = child(children, "Deployment")["spec"]["template"]
    assert template["metadata"]["annotations"] != old_template["metadata"]["annotations"]
    # A digest only: neither the URL nor its base64 is in the pod template.
    text = json.dumps(template)
    assert (
        "new-password" not in text and base64.b64encode(NEW.redis_url.encode()).decode() not in text
    )
    (event,) = actions.events
    assert event.reason == "SettingsApplied" and not event.warning
    assert event.message.startswith("the operator's --redis-url changed, so the engine pods roll")
    assert "Secret m-normal-redis: data.url" in event.message

    # The same Secret edited by hand is drift: set back, the pods left alone.
    edited = copy.deepcopy(children)
    child(edited, "Secret")["data"]["url"] = base64.b64encode(b"redis://elsewhere:6379/0").decode()
    actions = plan(body, edited, OLD, now=NOW)
    assert [p.kind for p in actions.patches] == ["Secret"]
    assert actions.events == (Event("DriftRepaired", "Secret m-normal-redis: data.url"),)


def test_a_new_engine_image_of_the_operator_is_its_setting_and_a_hand_edit_is_drift():
    body = running({}, desired=1)
    children = built(body, OLD)
    upgraded = OperatorDefaults(image="engine:2", redis_url=OLD.redis_url)

    actions = plan(body, children, upgraded, now=NOW)
    (patch,) = actions.patches
    containers = patch.patch["spec"]["template"]["spec"]["containers"]
    assert [c["image"] for c in containers] == ["engine:2"]
    (event,) = actions.events
    assert event.reason == "SettingsApplied"
    assert event.message.startswith("the operator's --engine-image changed, so the engine pods")
    assert "Deployment m-normal: " in event.message and ".image" in event.message

    # The image set by hand: set back, and said to be a hand edit.
    edited = copy.deepcopy(children)
    child(edited, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"] = "mine:1"
    (event,) = plan(body, edited, OLD, now=NOW).events
    assert event == Event(
        "DriftRepaired", "Deployment m-normal: spec.template.spec.containers[0].image"
    )
    # Both at once: the pods were not as the operator built them, so not its setting.
    (event,) = plan(body, edited, upgraded, now=NOW).events
    assert event.reason == "DriftRepaired" and "containers[0].image" in event.message


def test_new_default_pull_secrets_are_the_operators_setting_unless_the_spec_names_its_own():
    body = running({}, desired=1)
    children = built(body, OLD)
    with_secret = OperatorDefaults(
        image=OLD.image, redis_url=OLD.redis_url, image_pull_secrets=("regcred",)
    )

    actions = plan(body, children, with_secret, now=NOW)
    (patch,) = actions.patches
    assert patch.patch["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    (event,) = actions.events
    assert event.reason == "SettingsApplied"
    assert event.message.startswith("the operator's --engine-image-pull-secret changed")

    # A model with its own image and Secrets keeps them: the defaults are not its.
    own = running({}, desired=1)
    own["spec"] |= {"image": "mine:1", "imagePullSecrets": [{"name": "mine"}]}
    children = built(own, OLD)
    assert plan(own, children, with_secret, now=NOW).patches == ()

    # The spec dropping its own image is the spec's change, not the operator's.
    edited = copy.deepcopy(own)
    del edited["spec"]["image"]
    edited["metadata"]["generation"] = 2
    (event,) = plan(edited, children, OLD, now=NOW).events
    assert event.reason == "SpecApplied" and "containers[0].image" in event.message


def test_a_bound_that_moves_the_count_scales_the_role_and_names_the_bound():
    children = built(running({"replicas": 4, "maxReplicas": 6}, desired=4))

    lowered = running({"maxReplicas": 2}, desired=4, generation=2)
    actions = plan(lowered, children, OLD, now=NOW)
    (patch,) = actions.patches
    assert patch.patch["spec"]["replicas"] == 2
    assert actions.events == (Event("ScaledDown", "normal scale 4->2: above maxReplicas 2"),)
    assert actions.status["lastScale"] == {
        "role": "normal",
        "from": 4,
        "to": 2,
        "reason": "normal scale 4->2: above maxReplicas 2",
        "time": NOW,
    }
    # The controller sets pod-deletion costs before a clamp that shrinks the role.
    assert [(c.found, c.replicas) for c in actions.clamps] == [(4, 2)]

    raised = running({"minReplicas": 5, "maxReplicas": 6}, desired=4, generation=2)
    assert plan(raised, children, OLD, now=NOW).events == (
        Event("ScaledUp", "normal scale 4->5: below minReplicas 5"),
    )


def test_a_bound_that_moves_in_the_pass_the_autoscaler_decides_is_named_in_its_scale():
    # The autoscaler decided from the clamped count (2), and the scale read 2->1 with
    # no word of the bound, though the Deployment went from 4 to 1. It reads as every
    # scale does: "<role> scale <from>-><to>: why".
    children = built(running({"replicas": 4, "maxReplicas": 6}, desired=4))
    lowered = running({"maxReplicas": 2}, desired=4, generation=2)
    reason = "normal scale 2->1: kv_cache asks 0.86, 0.43x current"
    decision = Decision(RoleName.NORMAL, 1, 2, 1, reason, ScalingHistory())
    actions = plan(lowered, children, OLD, now=NOW, scaled={RoleName.NORMAL: decision})
    (patch,) = actions.patches
    assert patch.patch["spec"]["replicas"] == 1
    said = "normal scale 4->1: above maxReplicas 2, then kv_cache asks 0.86, 0.43x current"
    assert actions.events == (Event("ScaledDown", said),)
    assert actions.status["lastScale"] == {
        "role": "normal",
        "from": 4,
        "to": 1,
        "reason": said,
        "time": NOW,
    }


def test_a_hand_scale_outside_the_bounds_is_drift_and_one_inside_is_kept():
    body = running({"replicas": 2, "maxReplicas": 4}, desired=2)
    children = built(body)
    child(children, "Deployment")["spec"]["replicas"] = 10

    actions = plan(body, children, OLD, now=NOW)
    (patch,) = actions.patches
    assert patch.patch["spec"]["replicas"] == 4
    message = "Deployment m-normal: spec.replicas (10, above maxReplicas 4)"
    assert actions.events == (Event("DriftRepaired", message),)
    assert "lastScale" not in actions.status  # no scaling decision, a repair

    child(children, "Deployment")["spec"]["replicas"] = 3
    actions = plan(body, children, OLD, now=NOW)
    assert actions.patches == () and actions.events == ()
    assert actions.status["roles"]["normal"]["desired"] == 3


def model_named(
    name: str,
    created: str,
    served: str | None = None,
    namespace: str = "default",
    serving: str | None = None,
) -> dict[str, Any]:
    """A ModelDeployment asking to serve `served`, whose pods serve `serving` (its status)."""
    source = {"path": "smollm2", **({"servedModelName": served} if served else {})}
    return {
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": {"model": source, "normal": {}},
        "status": {"servedModelName": serving} if serving else {},
    }


def test_the_oldest_model_holds_a_served_name_then_the_name_decides():
    a = model_named("a", "2026-01-01T00:00:02Z", "shared")
    b = model_named("b", "2026-01-01T00:00:01Z", "shared")
    c = model_named("c", "2026-01-01T00:00:01Z", "shared")  # as old as b: b's name is first
    models = [a, b, c]
    assert served_name_holder(a, models, SHARED) == "claimed by ModelDeployment b"
    assert served_name_holder(c, models, SHARED) == "claimed by ModelDeployment b"
    assert served_name_holder(b, models, SHARED) is None
    assert served_name_holder(model_named("d", NOW, "own"), models, SHARED) is None
    # Without servedModelName the name is metadata.name.
    plain = model_named("shared", "2026-01-01T00:00:03Z")
    assert served_name_holder(plain, [*models, plain], SHARED) == "claimed by ModelDeployment b"
    # A model being deleted lets go at once.
    going = copy.deepcopy(b)
    going["metadata"]["deletionTimestamp"] = NOW
    assert served_name_holder(a, [a, going, c], SHARED) == "claimed by ModelDeployment c"


def test_a_rename_in_progress_holds_both_its_names():
    # Its pods serve the old name and the new one until the rollout ends: an older
    # model asking either is refused, not let onto the same queue.
    renaming = model_named("x", "2026-01-01T00:00:05Z", "bar", serving="bar")
    renaming["status"]["retiringServedModelNames"] = ["foo"]
    for name in ("foo", "bar"):
        older = model_named("y", "2026-01-01T00:00:01Z", name)
        assert served_name_holder(older, [older, renaming], SHARED) == "served by ModelDeployment x"
        assert served_name_holder(renaming, [older, renaming], SHARED) is None
    renaming["status"]["retiringServedModelNames"] = None  # rolled: foo is free
    older = model_named("y", "2026-01-01T00:00:01Z", "foo")
    assert served_name_holder(older, [older, renaming], SHARED) is None


def test_a_served_name_is_held_across_namespaces_on_the_operators_redis():
    # One queue per served name in the shared Redis: another team's model of the same
    # name would take this one's prompts. Whose model holds it is not said.
    theirs = model_named("llama", "2026-01-01T00:00:01Z", "llama-8b", namespace="team-a")
    mine = model_named("evil", "2026-01-01T00:00:02Z", "llama-8b", namespace="team-b")
    assert (
        served_name_holder(mine, [theirs, mine], SHARED)
        == "claimed by a ModelDeployment of another namespace"
    )
    assert served_name_holder(theirs, [theirs, mine], SHARED) is None
    # The same name in two namespaces is two models, not one.
    twin = model_named("llama", "2026-01-01T00:00:03Z", "other", namespace="team-b")
    assert served_name_holder(twin, [theirs, twin], SHARED) is None
    # A namespace on its own Redis shares no queue with the others'.
    own = copy.deepcopy(mine)
    own["spec"]["redis"] = {"url": "redis://redis:6379/0"}
    assert served_name_holder(own, [theirs, own], SHARED) is None
    assert served_name_holder(theirs, [theirs, own], SHARED) is None


@pytest.mark.parametrize(
    "url",
    [
        "redis://tandem-redis.tandem.svc:6379/0",
        "rediss://:pw@TANDEM-REDIS.tandem.svc.cluster.local.:6379",
        "redis://tandem-redis.tandem/0",
        "redis://tandem-redis.tandem.svc?db=0",
        "redis://tandem-redis.tandem.svc:6379/00",  # database 0, as redis-py reads it
    ],
)
def test_a_spec_redis_that_names_the_operators_redis_shares_its_queues(url):
    # Written out in spec.redis, the shared Redis is still the other teams' queues.
    theirs = model_named("llama", "2026-01-01T00:00:01Z", "llama-8b", namespace="team-a")
    mine = model_named("evil", "2026-01-01T00:00:02Z", "llama-8b", namespace="team-b")
    mine["spec"]["redis"] = {"url": url}
    assert (
        served_name_holder(mine, [theirs, mine], SHARED)
        == "claimed by a ModelDeployment of another namespace"
    )
    # Two namespaces spelling one Service in full share it too.
    both = copy.deepcopy(theirs)
    both["spec"]["redis"] = {"url": "redis://tandem-redis.tandem.svc.cluster.local:6379/0"}
    assert (
        served_name_holder(mine, [both, mine], SHARED)
        == "claimed by a ModelDeployment of another namespace"
    )


@pytest.mark.parametrize(
    "url",
    [
        "redis://tandem-redis:6379/0",  # a Service of team-b's own namespace
        "redis://tandem-redis.tandem.svc:6379/1",  # another database
        "redis://tandem-redis.tandem.svc:6379/0?db=2",  # another, as redis-py reads it
        "redis://tandem-redis.tandem.svc:6380/0",  # another port
        "unix:///run/redis.sock",
    ],
)
def test_a_spec_redis_elsewhere_shares_nothing_with_other_namespaces(url):
    theirs = model_named("llama", "2026-01-01T00:00:01Z", "llama-8b", namespace="team-a")
    mine = model_named("evil", "2026-01-01T00:00:02Z", "llama-8b", namespace="team-b")
    mine["spec"]["redis"] = {"url": url}
    assert served_name_holder(mine, [theirs, mine], SHARED) is None
    # A URL in a Secret is not read: the model's namespace alone decides.
    hidden = copy.deepcopy(mine)
    hidden["spec"]["redis"] = {"urlSecretRef": {"name": "redis", "key": "url"}}
    assert served_name_holder(hidden, [theirs, hidden], SHARED) is None


@pytest.mark.parametrize("older", ["moved", "theirs"])
def test_a_model_serves_its_name_on_the_redis_of_its_last_applied_spec(older):
    # Its spec moved onto the operator's Redis, its pods still on their own: another
    # namespace's model serving the name there keeps it, and this one is refused, however
    # old each is (the older took the name, the younger lost its pods to zero).
    own = {"url": "redis://redis.team-a:6379/0"}
    times = {"moved": "2026-01-01T00:00:01Z", "theirs": "2026-01-01T00:00:02Z"}
    if older == "theirs":
        times = {"moved": times["theirs"], "theirs": times["moved"]}
    moved = model_named("m", times["moved"], namespace="team-a", serving="m")
    theirs = model_named("m", times["theirs"], namespace="team-b", serving="m")
    applied = copy.deepcopy(moved)
    applied["spec"]["redis"] = own
    moved["status"]["servedRedis"] = queues_digest(applied, SHARED)
    theirs["status"]["servedRedis"] = queues_digest(theirs, SHARED)
    models = [moved, theirs]
    taken = "served by a ModelDeployment of another namespace"
    assert served_name_holder(moved, models, SHARED) == taken
    assert served_name_holder(theirs, models, SHARED) is None
    # On its own Redis still, as applied, it holds the name there.
    assert served_name_holder(applied, [applied, theirs], SHARED) is None
    # A status from before the digest was recorded: where its spec says.
    del theirs["status"]["servedRedis"]
    assert served_name_holder(moved, models, SHARED) == taken


def test_a_model_that_serves_a_name_keeps_it_when_another_is_edited_to_claim_it():
    # The oldest claimant held it whatever served it: an edit of an older model to a
    # name in use (a typo, a copy-paste) took the younger, serving model to zero pods,
    # and the older one's own name was then served by nobody.
    older = model_named("a", "2026-01-01T00:00:01Z", "mistral", serving="llama")
    younger = model_named("b", "2026-01-01T00:00:02Z", "mistral", serving="mistral")
    models = [older, younger]
    assert served_name_holder(younger, models, SHARED) is None
    assert served_name_holder(older, models, SHARED) == "served by ModelDeployment b"
    # A rename refused leaves the pods serving the old name, which nobody else may claim.
    newcomer = model_named("c", "2026-01-01T00:00:00Z", "llama")
    assert (
        served_name_holder(newcomer, [*models, newcomer], SHARED) == "served by ModelDeployment a"
    )
    # Two that both serve it (their queues newly shared): the oldest of them.
    both = model_named("d", "2026-01-01T00:00:03Z", "mistral", serving="mistral")
    assert served_name_holder(younger, [*models, both], SHARED) is None
    assert served_name_holder(both, [*models, both], SHARED) == "served by ModelDeployment b"


@pytest.mark.parametrize("reason", ["InvalidSpec", "ChildTaken"])
def test_an_older_model_refused_before_it_served_does_not_hold_the_name(reason):
    # It never applied a spec and runs no pods: the name was served by nobody, the valid
    # younger model told the name "is served by" it.
    refused = model_named("b", "2026-01-01T00:00:01Z", "llama")
    refused["metadata"]["generation"] = 1
    refused["status"] = {"phase": "Invalid", "reason": reason, "observedGeneration": 1}
    valid = model_named("a", "2026-01-01T00:00:02Z", "llama")
    assert served_name_holder(valid, [refused, valid], SHARED) is None
    # Edited since (a fix not yet looked at): it claims again, as the older.
    refused["metadata"]["generation"] = 2
    assert served_name_holder(valid, [refused, valid], SHARED) == "claimed by ModelDeployment b"
    # Waiting for the name itself is no refusal of its spec: two such would both take it.
    refused["status"] = {"phase": "Invalid", "reason": "ServedNameTaken", "observedGeneration": 2}
    assert served_name_holder(valid, [refused, valid], SHARED) == "claimed by ModelDeployment b"


def test_a_refused_rename_leaves_the_pods_serving_the_old_name():
    # As an invalid edit leaves them: zeroed, the model served nothing at all.
    body = running({"replicas": 2, "maxReplicas": 2}, desired=2)
    body["status"]["servedModelName"] = "m"
    children = built(body)
    child(children, "Deployment")["status"] = {"replicas": 2, "readyReplicas": 2}
    body["spec"]["model"]["servedModelName"] = "taken"

    actions = plan(body, children, OLD, now=NOW, holder="ModelDeployment other")
    assert not actions.creates and not actions.deletes and not actions.patches
    status = actions.status
    assert (status["phase"], status["reason"]) == ("Invalid", "ServedNameTaken")
    assert "its pods serve 'm' meanwhile" in status["message"]
    # The counts stand (not zeroed): the pods serve on, as their Deployment says.
    assert status["roles"] == {"normal": {"desired": 2, "replicas": 2, "ready": 2}}


def test_a_model_records_the_name_its_pods_serve():
    body = running({}, desired=1)
    assert plan(body, [], OLD, now=NOW).status["servedModelName"] == "m"
    body["spec"]["model"]["servedModelName"] = "chat"
    assert plan(body, [], OLD, now=NOW).status["servedModelName"] == "chat"


def test_a_model_whose_name_is_taken_serves_nothing_and_says_so_once():
    body = running({"replicas": 2, "maxReplicas": 2}, desired=2)
    children = built(body)

    actions = plan(body, children, OLD, now=NOW, holder="served by ModelDeployment older")
    assert not actions.creates and not actions.deletes
    assert [(p.name, p.patch) for p in actions.patches] == [("m-normal", {"spec": {"replicas": 0}})]
    status = actions.status
    assert (status["phase"], status["reason"]) == ("Invalid", "ServedNameTaken")
    assert "servedModelName 'm' is served by ModelDeployment older" in status["message"]
    assert status["roles"]["normal"]["desired"] == 0
    (event,) = actions.events
    assert event.reason == "ServedNameTaken" and event.warning

    # The next pass finds what it wrote: no second Warning. A new model creates nothing.
    body["status"].update(status)
    assert plan(body, children, OLD, now=NOW, holder="served by ModelDeployment older").events == ()
    fresh = plan(running({}, desired=1), [], OLD, now=NOW, holder="served by ModelDeployment older")
    assert fresh.creates == ()


def _autoscaled(children: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """`children` after the autoscaler set the Deployment to `count` pods."""
    children = copy.deepcopy(children)
    child(children, "Deployment")["spec"]["replicas"] = count
    return children


def test_an_edit_of_the_spec_replicas_sets_the_count_once():
    children = _autoscaled(built(running({"replicas": 2, "maxReplicas": 6}, desired=2)), 4)
    unchanged = running({"replicas": 2, "maxReplicas": 6}, desired=4)
    assert not plan(unchanged, children, OLD, now=NOW).touches_children, "the autoscaler's 4"

    edited = running({"replicas": 1, "maxReplicas": 6}, desired=4, generation=2)
    actions = plan(edited, children, OLD, now=NOW)
    (patch,) = actions.patches
    assert patch.patch["spec"]["replicas"] == 1
    # The record is bookkeeping: the Event says what changed, in the autoscaler's words.
    said = "normal scale 4->1: spec.normal.replicas set to 1"
    assert actions.events == (Event("ScaledDown", said),)
    assert actions.status["lastScale"]["reason"] == said
    assert actions.shrinking == (RoleName.NORMAL,), "the least-loaded pods go first"

    # Applied once: the autoscaler (or a hand scale) moves on from there.
    applied = _autoscaled(children, 1)
    applied_deployment = child(applied, "Deployment")
    applied_deployment["metadata"]["annotations"].update(patch.patch["metadata"]["annotations"])
    assert not plan(edited, _autoscaled(applied, 3), OLD, now=NOW).touches_children


def test_a_deployment_made_before_the_replicas_record_keeps_its_count():
    children = _autoscaled(built(running({"replicas": 2, "maxReplicas": 6}, desired=2)), 4)
    del child(children, "Deployment")["metadata"]["annotations"]["serving.tandem.dev/spec-replicas"]
    upgraded = running({"replicas": 2, "maxReplicas": 6}, desired=4)
    actions = plan(upgraded, children, OLD, now=NOW)
    (patch,) = actions.patches
    assert patch.drift == ("metadata.annotations.serving.tandem.dev/spec-replicas",)
    assert patch.patch["spec"]["replicas"] == 4, "an operator upgrade resets no count"
    assert patch.patch["metadata"]["annotations"]["serving.tandem.dev/spec-replicas"] == "2"
    assert actions.events == () and "lastScale" not in (actions.status or {})


def test_an_edit_of_the_spec_replicas_wins_over_a_decision_made_in_the_same_pass():
    children = _autoscaled(built(running({"replicas": 2, "maxReplicas": 6}, desired=2)), 4)
    edited = running({"replicas": 1, "maxReplicas": 6}, desired=4, generation=2)
    # The autoscaler read the edited count (1) before this pass applied it, and asks 2.
    decision = Decision(RoleName.NORMAL, 2, 1, 2, "normal scale 1->2: kv_cache", ScalingHistory())
    actions = plan(edited, children, OLD, now=NOW, scaled={RoleName.NORMAL: decision})
    (patch,) = actions.patches
    assert patch.patch["spec"]["replicas"] == 1
    said = "normal scale 4->1: spec.normal.replicas set to 1"
    assert actions.events == (Event("ScaledDown", said),)
    assert actions.shrinking == (RoleName.NORMAL,)


@pytest.mark.parametrize(
    "record", ['{"image": ["x"]}', '{"imagePullSecrets": [1]}', "[1]", "{", '{"image": null}']
)
def test_a_mangled_defaults_record_is_read_as_none_not_a_wedge(record):
    # `"image": ["x"]` raised TypeError (unhashable) at every pass: no spec edit was
    # applied again, and the status stayed Ready at the old generation.
    body = running({}, desired=1)
    children = built(body, OLD)
    deployment = child(children, "Deployment")
    deployment["metadata"]["annotations"][DEFAULTS_ANNOTATION] = record
    upgraded = OperatorDefaults(image="engine:2", redis_url=OLD.redis_url)
    (patch,) = plan(body, children, upgraded, now=NOW).patches
    assert f"metadata.annotations.{DEFAULTS_ANNOTATION}" in patch.drift  # written right again
