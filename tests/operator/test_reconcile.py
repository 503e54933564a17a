"""The operator's pure parts: plans, drift, status phases and the autoscaler glue. No I/O."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from tandem.operator.autoscaler import Decision, ScalingHistory
from tandem.operator.drift import OWNED_KEYS_ANNOTATION, ChildKey, drift, repair_patch
from tandem.operator.manifests import (
    DEFAULTS_ANNOTATION,
    DELETION_COST_ANNOTATION,
    OperatorDefaults,
)
from tandem.operator.pod_load import PodSample
from tandem.operator.pod_trouble import PodTrouble, role_trouble
from tandem.operator.reconcile import plan
from tandem.operator.replica_counts import role_replicas
from tandem.operator.role_name import RoleName
from tandem.operator.scaling import (
    ScalerMemory,
    cost_changes,
    deletion_costs,
    evaluate,
    plan_resize,
    policy,
    scrape_targets,
)
from tandem.operator.status import (
    RoleCounts,
    Stall,
    conditions,
    refusal_status,
    status_patch,
    valid_status,
)
from tandem.operator.status_model import Phase
from tandem.operator.validation import validate_spec
from tandem.protocol import PRIORITIES
from tandem.queue_state import QueueState

DEFAULTS = OperatorDefaults(image="engine:1", redis_url="redis://r:6379/0")
NOW = "2026-01-01T00:00:00Z"
META = {"name": "m", "namespace": "ns", "uid": "u-1", "generation": 1}


def model(role: dict[str, Any] | None = None, status: dict[str, Any] | None = None) -> dict:
    spec = {"model": {"path": "smollm2"}, "mode": "Normal", "normal": role or {}}
    return {"metadata": dict(META), "spec": spec, "status": status or {}}


def children_of(model_body: dict[str, Any]) -> list[dict[str, Any]]:
    return [copy.deepcopy(m) for m in plan(model_body, [], DEFAULTS, now=NOW).creates]


def rolled_out(children: list[dict], replicas: int) -> None:
    """The children's Deployments as their controller leaves them: every pod ready."""
    for child in children:
        if child["kind"] == "Deployment":
            child["metadata"]["generation"] = 1
            counts = {"replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas}
            child["status"] = {"observedGeneration": 1, **counts}


def test_a_new_model_creates_its_children_and_reports_pending():
    actions = plan(model(), [], DEFAULTS, now=NOW)
    kinds = sorted(c["kind"] for c in actions.creates)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]
    assert not actions.patches and not actions.deletes
    assert actions.status["phase"] == "Pending"
    counts = {"desired": 1, "replicas": 0, "ready": 0, "serving": 0}
    assert actions.status["roles"] == {"normal": counts}


def test_what_the_api_server_adds_is_not_drift():
    children = children_of(model({"resources": {"limits": {"cpu": 2, "memory": "1Gi"}}}))
    for child in children:
        child["metadata"].update(uid="x", resourceVersion="7", creationTimestamp=NOW)
        child["status"] = {"anything": True}
        if child["kind"] == "Service":
            child["spec"].update(clusterIPs=["None"], sessionAffinity="None", type="ClusterIP")
        if child["kind"] == "Deployment":
            pod = child["spec"]["template"]["spec"]
            pod.update(dnsPolicy="ClusterFirst", restartPolicy="Always")
            pod["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
            # The API server writes quantities back in canonical form.
            pod["containers"][0]["resources"]["limits"] = {"cpu": "2", "memory": "1024Mi"}
    assert (
        plan(
            model({"resources": {"limits": {"cpu": 2, "memory": "1Gi"}}}),
            children,
            DEFAULTS,
            now=NOW,
        ).patches
        == ()
    )


def _omit_empty(value: Any) -> Any:
    """What the API server stores: Go's omitempty drops empty values."""
    if isinstance(value, dict):
        kept = {k: _omit_empty(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in ("", [], {}, None, False, 0)}
    if isinstance(value, list):
        return [_omit_empty(v) for v in value]
    return value


def test_empty_values_the_api_server_drops_are_not_drift():
    # The docs' own "key empty with Exists" toleration, and empty resource maps:
    # compared as written, every pass "repaired" them, forever.
    role = {
        "tolerations": [{"key": "", "operator": "Exists"}],
        "resources": {"limits": {}, "requests": {}},
    }
    stored = [_omit_empty(c) for c in children_of(model(role))]
    assert plan(model(role), stored, DEFAULTS, now=NOW).patches == ()
    # A real change next to them is still drift.
    deployment = next(c for c in stored if c["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["tolerations"][0]["operator"] = "Equal"
    (patch,) = plan(model(role), stored, DEFAULTS, now=NOW).patches
    assert patch.drift == ("spec.template.spec.tolerations[0].operator",)


def test_owned_fields_changed_removed_or_added_are_drift_and_repaired():
    deployment = next(c for c in children_of(model()) if c["kind"] == "Deployment")
    desired = copy.deepcopy(deployment)
    pod = deployment["spec"]["template"]["spec"]
    pod["containers"][0]["image"] = "other:1"
    pod["nodeSelector"] = {"hand": "made"}
    del pod["volumes"]
    assert set(drift(desired, deployment)) == {
        "spec.template.spec.containers[0].image",
        "spec.template.spec.volumes",
        "spec.template.spec.nodeSelector",
    }
    patch = repair_patch(desired, deployment)
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None  # merge patch: remove
    assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == "engine:1"
    assert patch["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_pull_secrets_taken_out_of_the_spec_are_taken_out_of_the_pods():
    # A merge patch only adds: without a null for it, the old Secret would stay forever.
    with_secret = model()
    with_secret["spec"]["imagePullSecrets"] = [{"name": "regcred"}]
    children = children_of(with_secret)
    (patch,) = plan(model(), children, DEFAULTS, now=NOW).patches
    assert patch.drift == (
        f"metadata.annotations.{DEFAULTS_ANNOTATION}",  # the pods now take the default
        "spec.template.spec.imagePullSecrets",
    )
    assert patch.patch["spec"]["template"]["spec"]["imagePullSecrets"] is None
    assert plan(with_secret, children, DEFAULTS, now=NOW).patches == ()


def test_engine_ids_the_operator_no_longer_sets_are_taken_out_of_the_pods():
    # --engine-run-as-user none on a cluster whose engine pods were made with ids
    # (OpenShift refusing them): without nulls the merge patch kept the old ids forever.
    children = children_of(model())
    platform = replace(DEFAULTS, run_as_user=None)
    (patch,) = plan(model(), children, platform, now=NOW).patches
    ids = ("runAsUser", "runAsGroup", "fsGroup")
    assert patch.drift == tuple(f"spec.template.spec.securityContext.{key}" for key in ids)
    security = patch.patch["spec"]["template"]["spec"]["securityContext"]
    assert {key: security[key] for key in ids} == dict.fromkeys(ids)
    assert security["runAsNonRoot"] is True
    # Back to a fixed user: the ids are missing, which is drift already.
    without = plan(model(), [], platform, now=NOW).creates
    (back,) = plan(model(), without, DEFAULTS, now=NOW).patches
    assert back.patch["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    assert plan(model(), without, platform, now=NOW).patches == ()


def test_extra_configmap_keys_are_drift():
    config = next(c for c in children_of(model()) if c["kind"] == "ConfigMap")
    desired = copy.deepcopy(config)
    config["data"]["extra"] = "1"
    assert drift(desired, config) == ("data.extra",)
    assert repair_patch(desired, config)["data"]["extra"] is None


@pytest.mark.parametrize(
    ("kind", "path"),
    [("Service", ("selector",)), ("PodDisruptionBudget", ("selector", "matchLabels"))],
)
def test_a_key_added_to_a_selector_is_drift_and_removed(kind, path):
    # The selector then matched no engine pod: the Service discovered none, the budget
    # protected none from a drain, and the operator never put it back.
    (child,) = [c for c in children_of(model()) if c["kind"] == kind]
    desired = copy.deepcopy(child)
    selector = child["spec"]
    for key in path:
        selector = selector[key]
    selector["typo"] = "x"
    assert drift(desired, child) == (".".join(("spec", *path, "typo")),)
    patch = repair_patch(desired, child)["spec"]
    for key in path:
        patch = patch[key]
    assert patch["typo"] is None


def test_only_keys_a_manifest_set_are_removed_and_an_unrecorded_child_loses_every_extra():
    body = model({"nodeSelector": {"pool": "gpu"}})
    (wanted,) = [c for c in children_of(body) if c["kind"] == "Deployment"]
    deployment = copy.deepcopy(wanted)
    deployment["spec"]["template"]["spec"]["nodeSelector"]["zone"] = "a"  # someone else's
    assert drift(wanted, deployment) == ()
    # Made before the record was kept: every extra key is the operator's, once.
    del deployment["metadata"]["annotations"][OWNED_KEYS_ANNOTATION]
    assert "spec.template.spec.nodeSelector.zone" in drift(wanted, deployment)
    patch = repair_patch(wanted, deployment)
    assert patch["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu", "zone": None}
    assert OWNED_KEYS_ANNOTATION in patch["metadata"]["annotations"]


def test_a_role_of_another_mode_is_deleted_once_the_new_roles_are_ready():
    children = children_of(model())
    split = model()
    split["spec"] = {"model": {"path": "x"}, "mode": "Disaggregated", "prefill": {}, "decode": {}}
    actions = plan(split, children, DEFAULTS, now=NOW)
    assert len(actions.creates) == 10 and not actions.deletes  # normal serves meanwhile

    new = [copy.deepcopy(m) for m in actions.creates]
    for child in new:
        if child["kind"] == "Deployment":
            child["status"] = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 0}
    assert not plan(split, children + new, DEFAULTS, now=NOW).deletes  # not ready yet
    for child in new:
        if child["kind"] == "Deployment":
            child["status"]["readyReplicas"] = 1
    actions = plan(split, children + new, DEFAULTS, now=NOW)
    assert {k.name for k in actions.deletes} == {"m-normal", "m-normal-engine", "m-normal-redis"}


def test_a_new_role_that_may_scale_to_zero_runs_a_pod_while_the_old_mode_serves():
    # Started at its minReplicas 0, the new prefill role counted as ready at once: the
    # serving normal pods were deleted with no pod loading the model to take over.
    children = children_of(model())
    (old,) = [c for c in children if c["kind"] == "Deployment"]
    old["status"] = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    split = model()
    split["spec"] = {
        "model": {"path": "x"},
        "mode": "Disaggregated",
        "prefill": {"minReplicas": 0, "maxReplicas": 2},
        "decode": {},
    }
    actions = plan(split, children, DEFAULTS, now=NOW)
    new = [copy.deepcopy(m) for m in actions.creates]
    assert _replicas(new) == {"m-prefill": 1, "m-decode": 1} and not actions.deletes
    for child in new:
        if child["kind"] == "Deployment":
            child["status"] = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 0}
    # The autoscaler's zero waits for the handover too.
    why = "prefill scale 1->0: idle"
    idle = {RoleName.PREFILL: Decision(RoleName.PREFILL, 0, 1, 0, why, ScalingHistory())}
    actions = plan(split, children + new, DEFAULTS, now=NOW, scaled=idle)
    assert not actions.deletes and not actions.patches
    for child in new:
        if child["kind"] == "Deployment":
            child["status"]["readyReplicas"] = 1
    actions = plan(split, children + new, DEFAULTS, now=NOW)
    assert {k.name for k in actions.deletes} == {"m-normal", "m-normal-engine", "m-normal-redis"}
    # With nothing served by the old mode, the role starts where its spec says.
    old["status"]["readyReplicas"] = 0
    fresh = plan(split, children, DEFAULTS, now=NOW).creates
    assert _replicas(fresh) == {"m-prefill": 0, "m-decode": 1}


def _replicas(children: list[dict[str, Any]]) -> dict[str, int]:
    """Each Deployment's replicas, by name."""
    return {
        c["metadata"]["name"]: c["spec"]["replicas"] for c in children if c["kind"] == "Deployment"
    }


def test_a_current_roles_old_redis_secret_stays_until_its_new_pods_are_ready():
    # Switched to spec.redis, the pass that rolled the pods deleted the operator's Redis
    # Secret they read: an old pod restarted meanwhile could not start.
    children = children_of(model())
    for child in children:
        if child["kind"] == "Deployment":
            child["status"] = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1}
    own = model()
    own["spec"]["redis"] = {"url": "redis://models-redis:6379/0"}
    actions = plan(own, children, DEFAULTS, now=NOW)
    assert "spec.template.spec.containers[0].env" in " ".join(
        path for p in actions.patches if p.kind == "Deployment" for path in p.drift
    )
    assert not actions.deletes  # rolling: the old pods still read it

    own["status"] = {**actions.status, "observedGeneration": 1}
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["metadata"]["generation"] = 2
    deployment["spec"] = next(p for p in actions.patches if p.kind == "Deployment").patch[
        "spec"
    ] | {"replicas": 1}
    deployment["status"] = {
        "observedGeneration": 2,
        "replicas": 1,
        "updatedReplicas": 1,
        "readyReplicas": 1,
        "availableReplicas": 1,
    }
    actions = plan(own, children, DEFAULTS, now=NOW)
    assert [k.name for k in actions.deletes] == ["m-normal-redis"]


def test_a_renamed_model_claims_its_old_name_until_its_new_pods_replace_the_old():
    # The status said only the new name as the rollout began: another model claimed
    # the old one while the old pods still served it, both on one queue.
    children = children_of(model())
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["metadata"]["generation"] = 1
    deployment["status"] = _rolled(1, replicas=1, updated=1, ready=1)
    renamed = model(status={"servedModelName": "shared", "reason": "AllReplicasReady"})
    renamed["spec"]["model"]["servedModelName"] = "a-only"
    actions = plan(renamed, children, DEFAULTS, now=NOW)
    served = ("servedModelName", "retiringServedModelNames")
    assert [actions.status[k] for k in served] == ["a-only", ["shared"]]

    # The Deployment rolls: a new pod ready beside the old one (maxSurge 1).
    renamed["status"] = {**renamed["status"], **actions.status}
    deployment["metadata"]["generation"] = 2
    deployment["spec"] = next(p for p in actions.patches if p.kind == "Deployment").patch[
        "spec"
    ] | {"replicas": 1}
    deployment["status"] = _rolled(2, replicas=2, updated=1, ready=1)
    status = plan(renamed, children, DEFAULTS, now=NOW).status or {}
    assert status.get("retiringServedModelNames", ["shared"]) == ["shared"]
    # The old pod gone, the old name is let go, however many pods are still starting.
    deployment["spec"]["replicas"] = 2
    deployment["status"] = _rolled(2, replicas=2, updated=2, ready=1)
    status = plan(renamed, children, DEFAULTS, now=NOW).status
    assert status["servedModelName"] == "a-only" and status["retiringServedModelNames"] is None


def test_a_rename_holds_its_old_name_while_the_deployment_has_not_caught_up():
    # Renamed while a pod was unschedulable (reason Unschedulable, not RollingOut), one
    # pass read the Deployment before its controller saw the new template and let the
    # old name go for good while the old pods still served it.
    renamed = model(
        {"replicas": 2, "maxReplicas": 2},
        status={"servedModelName": "a-only", "retiringServedModelNames": ["shared"]},
    )
    renamed["spec"]["model"]["servedModelName"] = "a-only"
    children = children_of(renamed)  # the new template, patched in the pass before
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["metadata"]["generation"] = 2
    deployment["status"] = _rolled(1, replicas=2, updated=2, ready=1)  # not caught up
    assert not plan(renamed, children, DEFAULTS, now=NOW).patches  # nothing rolls here
    status = plan(renamed, children, DEFAULTS, now=NOW).status or {}
    assert status.get("retiringServedModelNames", ["shared"]) == ["shared"]


@pytest.mark.parametrize("refusal", ["invalid spec", "name taken"])
def test_a_refused_model_lets_its_old_names_go_once_no_old_pod_runs(refusal):
    # A refusal applies no spec, and kept the names of a rename whose rollout had ended:
    # a name no pod served stayed held for as long as the refusal lasted.
    children = children_of(model())
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["metadata"]["generation"] = 2
    deployment["status"] = _rolled(2, replicas=1, updated=1, ready=1)  # rolled
    refused = model(status={"servedModelName": "y", "retiringServedModelNames": ["x"]})
    refused["spec"]["model"]["servedModelName"] = "y"
    holder = None
    if refusal == "invalid spec":
        refused["spec"]["normal"] = {"replicas": 9, "maxReplicas": 2}
    else:
        refused["spec"]["model"]["servedModelName"] = "z"
        holder = "served by ModelDeployment c"
    status = plan(refused, children, DEFAULTS, now=NOW, holder=holder).status
    assert status["phase"] == "Invalid" and status["retiringServedModelNames"] is None
    # While the old pods may still run, they are kept.
    deployment["status"] = _rolled(2, replicas=2, updated=1, ready=1)
    status = plan(refused, children, DEFAULTS, now=NOW, holder=holder).status
    assert "retiringServedModelNames" not in status  # left as they were


def _rolled(generation: int, *, replicas: int, updated: int, ready: int) -> dict[str, int]:
    """A Deployment's status as its controller writes it."""
    return {
        "observedGeneration": generation,
        "replicas": replicas,
        "updatedReplicas": updated,
        "readyReplicas": ready,
    }


def test_a_deployment_that_cannot_make_pods_says_why_in_the_status():
    # A quota or an admission webhook refuses every pod: its words, not a deadline's.
    children = children_of(model())
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["metadata"].update(generation=1)
    quota = 'pods "m-normal-1" is forbidden: exceeded quota: gpu'
    deployment["status"] = {
        "observedGeneration": 1,
        "replicas": 0,
        "conditions": [
            {"type": "Progressing", "status": "False", "message": "deadline exceeded"},
            {"type": "ReplicaFailure", "status": "True", "message": quota},
        ],
    }
    status = plan(model(), children, DEFAULTS, now=NOW).status
    assert (status["phase"], status["reason"]) == ("Degraded", "ReplicaFailure")
    assert f"normal cannot progress: normal: {quota}" in status["message"]


def test_replicas_come_from_the_autoscaler_then_the_deployment_then_status_then_spec():
    spec = validate_spec(model({"replicas": 2, "maxReplicas": 5})["spec"], name="m")
    key = ChildKey("Deployment", "m-normal")
    deployment = {key: {"spec": {"replicas": 4}}}
    reported = {"roles": {"normal": {"desired": 3}}}
    normal = RoleName.NORMAL
    assert role_replicas(spec, "m", deployment, reported, {normal: 5}) == {normal: 5}
    assert role_replicas(spec, "m", deployment, reported, {}) == {normal: 4}
    assert role_replicas(spec, "m", {}, reported, {}) == {normal: 3}
    assert role_replicas(spec, "m", {}, {}, {}) == {normal: 2}
    assert role_replicas(spec, "m", {key: {"spec": {"replicas": 9}}}, {}, {}) == {normal: 5}


def test_an_invalid_spec_plans_no_child_change_and_says_why():
    actions = plan(
        model({"minReplicas": 3, "maxReplicas": 1}), children_of(model()), DEFAULTS, now=NOW
    )
    assert not actions.touches_children
    assert actions.status["phase"] == "Invalid"
    assert "minReplicas must not exceed maxReplicas" in actions.status["message"]
    assert "roles" not in actions.status


def test_an_invalid_specs_counts_say_the_pods_as_they_are():
    # The counts stayed as they were: a pod that lost readiness, or the Deployment
    # deleted by hand (not made again while the spec is refused), still read 2/2 ready.
    previous = {"phase": "Ready", "roles": {"normal": {"desired": 2, "replicas": 2, "ready": 2}}}
    invalid = model({"minReplicas": 3, "maxReplicas": 1}, previous)
    children = children_of(model())
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["status"] = {"replicas": 2, "readyReplicas": 1}
    status = plan(invalid, children, DEFAULTS, now=NOW).status
    assert status["roles"] == {"normal": {"desired": 2, "replicas": 2, "ready": 1}}
    gone = [c for c in children if c["kind"] != "Deployment"]
    status = plan(invalid, gone, DEFAULTS, now=NOW).status
    assert status["roles"] == {"normal": {"desired": 2, "replicas": 0, "ready": 0}}


@pytest.mark.parametrize(
    ("counts", "previous", "expected"),
    [
        ({"desired": 2, "ready": 2, "replicas": 2}, {}, Phase.READY),
        ({"desired": 2, "ready": 0, "replicas": 2}, {}, Phase.PENDING),
        ({"desired": 2, "ready": 1, "replicas": 2}, {}, Phase.PROGRESSING),
        ({"desired": 0}, {}, Phase.READY),  # scaled to zero as asked
        # A Ready model that loses a pod it should still have:
        (
            {"desired": 2, "ready": 1, "replicas": 2},
            {"phase": "Ready", "desired": 2},
            Phase.DEGRADED,
        ),
        # ...stays Degraded until the pod is back:
        (
            {"desired": 2, "ready": 1, "replicas": 2},
            {"phase": "Degraded", "reason": "ReplicasUnavailable", "desired": 2},
            Phase.DEGRADED,
        ),
        # A new model past a quota or its progress deadline (a slow download) never
        # served: its first pod ready is progress, not "lost pods".
        (
            {"desired": 2, "ready": 1, "replicas": 2},
            {"phase": "Degraded", "reason": "ProgressDeadlineExceeded", "desired": 2},
            Phase.PROGRESSING,
        ),
        (
            {"desired": 1, "ready": 0, "replicas": 1},
            {"phase": "Degraded", "reason": "ReplicaFailure", "desired": 1},
            Phase.PENDING,
        ),
        # A scale-up is not a loss (test_a_scale_up_of_a_ready_model_stays_ready), nor is
        # a rollout:
        (
            {"desired": 2, "ready": 1, "replicas": 2, "rolling": True},
            {"phase": "Ready", "desired": 2},
            Phase.PROGRESSING,
        ),
        (
            {"desired": 2, "ready": 1, "replicas": 2, "stall": Stall("ReplicaFailure", "quota")},
            {},
            Phase.DEGRADED,
        ),
    ],
)
def test_phases(counts, previous, expected):
    before = {
        "phase": previous.get("phase"),
        "reason": previous.get("reason"),
        "roles": {"normal": {"desired": previous.get("desired")}},
    }
    status = valid_status(META, {RoleName.NORMAL: RoleCounts(**counts)}, before, NOW)
    assert status["phase"] == expected.value
    held = {c["type"] for c in status["conditions"] if c["status"] == "True"}
    # kstatus' pair: lost pods are being replaced (Reconciling), other trouble waits on
    # someone (Stalled).
    replacing = "Reconciling" if status["reason"] == "ReplicasUnavailable" else "Stalled"
    assert held == {Phase.READY: {"Ready"}, Phase.DEGRADED: {"Degraded", replacing}}.get(
        expected, {"Progressing", "Reconciling"}
    )
    (invalid,) = [c for c in status["conditions"] if c["type"] == "Invalid"]
    assert (invalid["status"], invalid["reason"]) == ("False", "SpecValid")


def test_a_scale_up_of_a_ready_model_stays_ready():
    # Every scale-up of the autoscaler turned Ready False: alerts and dashboards read an
    # outage while every pod that served still did.
    def step(previous, **counts):
        return valid_status(META, {RoleName.NORMAL: RoleCounts(**counts)}, previous, NOW)

    def held(status):
        return {c["type"] for c in status["conditions"] if c["status"] == "True"}

    ready = step({}, desired=2, replicas=2, ready=2)
    up = step(ready, desired=3, replicas=3, ready=2)
    assert (up["phase"], up["reason"]) == ("Ready", "ScalingUp")
    assert up["message"] == "scaling up: normal 2/3 ready"
    assert held(up) == {"Ready", "Progressing", "Reconciling"}
    # Still starting at the next evaluation, the count reported already: still scaling.
    again = step(up, desired=3, replicas=3, ready=2)
    assert (again["phase"], again["reason"]) == ("Ready", "ScalingUp")
    # A pod that served lost meanwhile is a loss.
    lost = step(again, desired=3, replicas=3, ready=1)
    assert (lost["phase"], lost["reason"]) == ("Degraded", "ReplicasUnavailable")
    done = step(again, desired=3, replicas=3, ready=3)
    assert (done["phase"], done["reason"], held(done)) == ("Ready", "AllReplicasReady", {"Ready"})
    # A new pod no node takes yet: the scheduler's words, the model still serving.
    full = PodTrouble("Unschedulable", "0/3 nodes are available")
    waits = step(ready, desired=3, replicas=3, ready=2, trouble=full)
    assert (waits["phase"], waits["reason"]) == ("Ready", "ScalingUp")
    assert "0/3 nodes are available" in waits["message"]
    # A pod that served blips (a readiness probe) while the new ones wait for a node: lost
    # while it is away, Ready again once it is back (it stayed Degraded to the end).
    blip = step(waits, desired=3, replicas=3, ready=1, trouble=full)
    assert (blip["phase"], blip["reason"]) == ("Degraded", "ReplicasUnavailable")
    back = step(blip, desired=3, replicas=3, ready=2, trouble=full)
    assert (back["phase"], back["reason"]) == ("Ready", "ScalingUp")
    # A new pod's blip loses nothing it served with.
    more = step(again, desired=4, replicas=4, ready=3)
    new_blip = step(more, desired=4, replicas=4, ready=2)
    assert (new_blip["phase"], new_blip["reason"]) == ("Ready", "ScalingUp")
    # A pod lost in the pass that sees the scale-up is lost, not starting.
    at_once = step(ready, desired=4, replicas=4, ready=1)
    assert (at_once["phase"], at_once["reason"]) == ("Degraded", "ReplicasUnavailable")
    # Not from zero: nothing served.
    idle = step({}, desired=0, replicas=0, ready=0)
    woken = step(idle, desired=1, replicas=1, ready=0)
    assert woken["phase"] == "Pending"
    # Nor a rollout's new pods.
    rolling = step(ready, desired=3, replicas=3, ready=2, rolling=True)
    assert rolling["phase"] == "Progressing"


def _kstatus(meta: dict, status: dict) -> str:
    """kstatus' reading of a custom resource (cli-utils' generic rules, which Flux's
    health checks and kpt use): only observedGeneration, Reconciling and Stalled count."""
    if status.get("observedGeneration") != meta.get("generation"):
        return "InProgress"
    held = {c["type"] for c in status.get("conditions") or [] if c["status"] == "True"}
    if "Reconciling" in held:
        return "InProgress"
    return "Failed" if "Stalled" in held else "Current"


def test_kstatus_tools_read_a_model_not_served_as_asked_as_not_current():
    # Without Reconciling and Stalled, a GitOps wait passed a model whose pods were
    # starting, crash-looping or refused: kstatus read every phase as Current.
    crash = PodTrouble("EngineCrashLoop", "engine exited")
    cases = {
        "Current": (RoleCounts(desired=1, replicas=1, ready=1), {}),
        "InProgress": (RoleCounts(desired=2, replicas=2, ready=1), {}),
        "Failed": (RoleCounts(desired=1, replicas=1, trouble=crash), {}),
    }
    for expected, (counts, previous) in cases.items():
        status = valid_status(META, {RoleName.NORMAL: counts}, previous, NOW)
        assert _kstatus(META, status) == expected, status["phase"]
    lost = {"phase": "Ready", "roles": {"normal": {"desired": 2}}}
    replacing = valid_status(META, {RoleName.NORMAL: RoleCounts(2, 2, 1)}, lost, NOW)
    assert (replacing["phase"], _kstatus(META, replacing)) == ("Degraded", "InProgress")
    refused = refusal_status(META, "spec.normal.maxReplicas: too many", {}, NOW)
    assert _kstatus(META, refused) == "Failed"


def test_a_scale_downs_pods_stopping_are_said_apart():
    # "normal 4/1 ready" under phase Ready: more ready than wanted read as a typo.
    counts = {RoleName.NORMAL: RoleCounts(desired=1, replicas=4, ready=4)}
    status = valid_status(META, counts, {}, NOW)
    assert (status["phase"], status["message"]) == ("Ready", "normal 1/1 ready (3 more stopping)")


def test_an_unchanged_status_is_not_written_and_transition_times_stay():
    counts = {RoleName.NORMAL: RoleCounts(desired=1, replicas=1, ready=1)}
    first = valid_status(META, counts, {}, NOW)
    assert status_patch(first, valid_status(META, counts, first, "2030-01-01T00:00:00Z")) is None
    later = conditions(Phase.PENDING, "PodsStarting", "-", first, 1, "2030-01-01T00:00:00Z")
    times = {c["type"]: c["lastTransitionTime"] for c in later}
    assert times["Ready"] == "2030-01-01T00:00:00Z" and times["Invalid"] == NOW


# ------------------------------------------------------------------ autoscaler glue


def pod(name: str, role: str = "decode", *, ready: bool = True, cost: int | None = None) -> dict:
    annotations = {} if cost is None else {DELETION_COST_ANNOTATION: str(cost)}
    return {
        "metadata": {
            "name": name,
            "labels": {"serving.tandem.dev/role": role},
            "annotations": annotations,
        },
        "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def sample(name: str, kv: float, running: int = 1) -> PodSample:
    return PodSample(
        pod=name,
        ready=True,
        scraped_at=1.0,
        kv_cache_usage=kv,
        requests_running=running,
        requests_waiting=0,
        waiting_prompt_tokens=0,
        token_budget=8192,
    )


QUIET = QueueState(dict.fromkeys(PRIORITIES, 0), 0, 0, 0, 0)


def test_policy_maps_the_role_fields():
    spec = validate_spec(
        {
            "model": {"path": "x"},
            "mode": "Disaggregated",
            "prefill": {"minReplicas": 0, "maxReplicas": 3, "targetQueuedTokensPerReplica": 100},
            "decode": {"targetKVCacheUsage": 0.5, "scaleUpStabilizationSeconds": 45},
        },
        name="m",
    )
    watermark = spec.engine.cache_prefill_watermark
    prefill, decode = (
        policy(spec.prefill, watermark=watermark),
        policy(spec.decode, watermark=watermark),
    )
    assert (prefill.min_replicas, prefill.max_replicas) == (0, 3)
    assert prefill.target_queued_tokens_per_replica == 100
    assert prefill.scale_to_zero_after_seconds == 300
    assert decode.target_kv_cache_usage == 0.5
    assert (prefill.scale_up_stabilization_seconds, decode.scale_up_stabilization_seconds) == (
        0,
        45,
    )


def test_only_ready_pods_with_an_address_are_scraped():
    gone = pod("c")
    del gone["status"]["podIP"]
    targets = scrape_targets([pod("a"), pod("b", ready=False), gone])
    assert targets == {"a": ("http://10.0.0.1:8100",)}


def test_a_data_parallel_pod_is_scraped_on_every_ranks_port():
    # Rank 0 alone was read: ranks 1-3 at 0.95 KV and a light rank 0 scaled a busy
    # role down, and the busiest pod could be the first drained.
    created = plan(model({"dataParallelSize": 4}), [], DEFAULTS, now=NOW).creates
    (deployment,) = [c for c in created if c["kind"] == "Deployment"]
    dp = pod("a", "normal")
    dp["spec"] = deployment["spec"]["template"]["spec"]
    urls = [f"http://10.0.0.1:{port}" for port in (8100, 8101, 8102, 8103)]
    assert scrape_targets([dp]) == {"a": tuple(urls)}


def test_the_least_loaded_pod_is_the_cheapest_to_remove():
    pods = [pod("busy"), pod("idle"), pod("new", ready=False)]
    samples = {"busy": sample("busy", 0.6, running=8), "idle": sample("idle", 0.1, running=1)}
    costs = deletion_costs(pods, samples)
    assert costs == {"new": 0, "idle": 1, "busy": 2}
    pods[1]["metadata"]["annotations"][DELETION_COST_ANNOTATION] = "1"
    assert cost_changes(pods, costs) == {"new": 0, "busy": 2}


def test_a_resize_starts_what_is_missing_and_drains_the_least_loaded_first():
    samples = [
        sample("busy", 0.6, running=8),
        None,  # starting: nothing to drain, so it goes first
        sample("light", 0.2, running=1),
        sample("idle", 0.1, running=1),
        sample("twin", 0.1, running=1),
    ]
    assert plan_resize(7, samples) == (2, [])
    assert plan_resize(5, samples) == (0, [])
    assert plan_resize(3, samples) == (0, [1, 3])
    # Equal loads keep their order; the busy pod is the last to go.
    assert plan_resize(0, samples) == (0, [1, 3, 4, 2, 0])


def test_an_edit_of_a_roles_replicas_is_no_rollout():
    # The edit moves the Deployment's spec-replicas annotation with its count: that
    # read as a new template, and a Ready model went Progressing RollingOut (3/2 ready).
    def ready_model(replicas: int, generation: int, status=None) -> dict:
        body = model({"replicas": replicas, "maxReplicas": 4}, status)
        body["metadata"]["generation"] = generation
        return body

    children = children_of(ready_model(3, 1))
    rolled_out(children, 3)
    ready = plan(ready_model(3, 1), children, DEFAULTS, now=NOW).status
    assert ready["phase"] == "Ready"
    edited = plan(ready_model(2, 2, ready), children, DEFAULTS, now=NOW)
    assert [p.name for p in edited.patches] == ["m-normal"]  # the count and its annotation
    assert (edited.status["phase"], edited.status["reason"]) == ("Ready", "AllReplicasReady")


@pytest.mark.parametrize(
    ("field", "value"),
    [("revisionHistoryLimit", 10), ("progressDeadlineSeconds", 60), ("strategy", {})],
)
def test_a_repair_outside_the_pod_template_is_no_rollout(field, value):
    # Any path but spec.replicas and metadata read as a new template: a hand edit of the
    # Deployment's history limit flipped a Ready model to RollingOut, no pod replaced.
    body = model({"replicas": 2, "maxReplicas": 4})
    body["metadata"]["generation"] = 1
    children = children_of(body)
    rolled_out(children, 2)
    body["status"] = plan(body, children, DEFAULTS, now=NOW).status
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["spec"][field] = value
    actions = plan(body, children, DEFAULTS, now=NOW)
    assert [p.name for p in actions.patches] == ["m-normal"]
    assert actions.status is None or actions.status["phase"] == "Ready"


def test_a_repair_the_api_server_undid_is_not_written_again_unless_it_changes():
    # A mutating webhook writes the drift back in the same request: its repair changed
    # nothing, and written at every pass, the model read RollingOut for ever.
    body = model({"replicas": 1, "maxReplicas": 1})
    children = children_of(body)
    (deployment,) = [c for c in children if c["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["tolerations"] = [{"key": "team"}]
    (repair,) = plan(body, children, DEFAULTS, now=NOW).patches
    assert repair.drift == ("spec.template.spec.tolerations",)
    undone = {ChildKey("Deployment", "m-normal"): replace(repair, generation=None)}
    assert plan(body, children, DEFAULTS, now=NOW, undone=undone).patches == ()
    deployment["spec"]["template"]["spec"]["nodeSelector"] = {"x": "y"}  # another drift
    (again,) = plan(body, children, DEFAULTS, now=NOW, undone=undone).patches
    assert "spec.template.spec.nodeSelector" in again.drift


def test_a_lost_pod_whose_replacement_no_node_takes_says_why():
    pod = {
        "metadata": {"name": "m-normal-z"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                },
            ],
        },
    }
    previous = {"phase": "Ready", "roles": {"normal": {"desired": 2, "replicas": 2, "ready": 2}}}
    trouble = role_trouble([pod])
    counts = {RoleName.NORMAL: RoleCounts(desired=2, replicas=2, ready=1, trouble=trouble)}
    status = valid_status(META, counts, previous, NOW)
    assert (status["phase"], status["reason"]) == ("Degraded", "ReplicasUnavailable")
    assert "normal lost pods: normal: pod m-normal-z cannot be scheduled" in status["message"]
    assert "Insufficient nvidia.com/gpu" in status["message"]


def test_a_mode_change_says_the_old_pods_serve_until_the_new_roles_are_ready():
    # It said "no engine pod ready yet" (Pending) while the normal pods served every request.
    normal = model({"replicas": 2, "maxReplicas": 4})
    children = children_of(normal)
    rolled_out(children, 2)
    ready = plan(normal, children, DEFAULTS, now=NOW).status
    split = {
        "metadata": {**META, "generation": 2},
        "spec": {
            "model": {"path": "smollm2"},
            "mode": "Disaggregated",
            "prefill": {},
            "decode": {},
        },
        "status": ready,
    }
    actions = plan(split, children, DEFAULTS, now=NOW)
    assert not actions.deletes  # the normal pods serve on
    assert (actions.status["phase"], actions.status["reason"]) == ("Progressing", "RollingOut")
    assert actions.status["message"].startswith("changing mode: normal 2 ready serve until")


@pytest.mark.parametrize(
    ("trouble", "why", "phase"),
    [
        ("Unschedulable", "pod m-decode-x cannot be scheduled: 0/3 nodes", "Progressing"),
        # Degraded (an image that does not pull) said nothing of the pods serving: read
        # alone, "0/1 ready" looked like an outage of a model still serving.
        ("ImagePullFailing", "pod m-decode-x: image cannot be pulled", "Degraded"),
    ],
)
def test_a_mode_change_whose_new_pods_are_in_trouble_says_why_and_who_serves(trouble, why, phase):
    counts = {
        RoleName.PREFILL: RoleCounts(desired=1, replicas=1, ready=0),
        RoleName.DECODE: RoleCounts(
            desired=1, replicas=1, ready=0, trouble=PodTrouble(trouble, why)
        ),
    }
    previous = {"phase": "Ready", "roles": {"normal": {"desired": 2, "ready": 2}}}
    status = valid_status(META, counts, previous, NOW, outgoing={"normal": 2})
    assert (status["phase"], status["reason"]) == (phase, trouble)
    assert why in status["message"]
    assert status["message"].endswith("changing mode: normal 2 ready serve meanwhile")


def test_a_first_evaluation_never_scales_down():
    spec = validate_spec(model({"replicas": 3, "maxReplicas": 3})["spec"], name="m")
    pods = [pod(n, "normal") for n in "abc"]
    samples = {n: sample(n, 0.01, running=0) for n in "abc"}
    first = evaluate(spec, {RoleName.NORMAL: 3}, pods, samples, QUIET, ScalerMemory(), now=0.0)
    assert first.changed == {}
    later = evaluate(spec, {RoleName.NORMAL: 3}, pods, samples, QUIET, first.memory, now=301.0)
    assert later.changed[RoleName.NORMAL].replicas == 1
