"""The operator against an emulated API server: children, rollouts, drift, status, deletion.

Autoscaling, peering and API failures: test_operator_scaling.py. A smoke test
against a real cluster runs when KUBECONFIG is set (test_operator_cluster.py).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kube_api import (
    CHILDREN,
    CLUSTER_PEERINGS,
    DEPLOYMENTS,
    MODELS,
    NAMESPACES,
    PODS,
    ApiError,
)
from support.kube_cluster import NAMESPACE, PEERING, eventually
from support.kube_cluster import normal_model as normal

from tandem.operator.manifests_pods import CONFIG_HASH_ANNOTATION
from tandem.operator.sources import MetricSources

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).resolve().parent / "golden"
# What the API server and the workload controllers add; never the operator's business.
SERVER_SET = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields")


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / f"{name}.yaml").read_text())


def phase(cluster: Any, name: str) -> str | None:
    return ((cluster.model(name) or {}).get("status") or {}).get("phase")


def condition(cluster: Any, name: str, kind: str) -> dict[str, Any]:
    conditions = (cluster.model(name) or {}).get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def server_free(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj.pop("status", None)
    for key in SERVER_SET:
        obj["metadata"].pop(key, None)
    return obj


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
async def test_each_example_makes_exactly_its_golden_children(cluster, operator, path):
    manifest = yaml.safe_load(path.read_text())
    name = manifest["metadata"]["name"]
    created = await cluster.apply(manifest)
    golden = list(yaml.safe_load_all((GOLDEN / path.name).read_text()))
    for child in golden:  # the goldens carry a fixed owner uid
        child["metadata"]["ownerReferences"][0]["uid"] = created["metadata"]["uid"]
    want = {(c["kind"], c["metadata"]["name"]): c for c in golden}

    def children() -> dict[tuple[str, str], dict[str, Any]]:
        return {(c["kind"], c["metadata"]["name"]): server_free(c) for c in cluster.children(name)}

    await eventually(lambda: children() == want, what=f"{name}'s children match the golden")
    await eventually(lambda: phase(cluster, name) == "Ready", what="Ready")


async def test_a_spec_change_rolls_the_pods(cluster, operator):
    await cluster.apply(example("smollm2-cpu"))
    await eventually(lambda: phase(cluster, "smollm2") == "Ready")
    before = cluster.child("Deployment", "smollm2-normal")
    old_hash = before["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    old_pods = {p["metadata"]["name"] for p in cluster.pods("smollm2", "normal")}

    await cluster.patch_model("smollm2", {"spec": {"engine": {"maxNumSeqs": 64}}})

    def rolled() -> bool:
        deployment = cluster.child("Deployment", "smollm2-normal")
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        return annotations[CONFIG_HASH_ANNOTATION] != old_hash

    await eventually(rolled, what="a new config hash in the pod template")
    assert cluster.child("ConfigMap", "smollm2-normal-engine")["data"]["max-num-seqs"] == "64"
    await eventually(
        lambda: (
            cluster.model("smollm2")["status"].get("observedGeneration") == 2
            and phase(cluster, "smollm2") == "Ready"
        ),
        what="Ready at generation 2",
    )
    # kubectl wait --for=condition=Ready reads the condition's own generation.
    conditions = cluster.model("smollm2")["status"]["conditions"]
    assert {c["observedGeneration"] for c in conditions} == {2}
    new_pods = {p["metadata"]["name"] for p in cluster.pods("smollm2", "normal")}
    assert new_pods and not new_pods & old_pods, "every pod was replaced"
    await eventually(lambda: cluster.events("SpecApplied"), what="a SpecApplied Event")


async def test_a_bound_change_reclamps_the_replicas(cluster, operator):
    await cluster.apply(normal(replicas=1, minReplicas=1, maxReplicas=3))
    await eventually(lambda: cluster.child("Deployment", "m-normal"), what="Deployment")

    await cluster.patch_model("m", {"spec": {"normal": {"replicas": None, "minReplicas": 2}}})
    await eventually(lambda: cluster.child("Deployment", "m-normal")["spec"]["replicas"] == 2)
    await eventually(lambda: cluster.model("m")["status"]["roles"]["normal"]["desired"] == 2)

    await cluster.patch_model("m", {"spec": {"normal": {"minReplicas": 1, "maxReplicas": 1}}})
    await eventually(lambda: cluster.child("Deployment", "m-normal")["spec"]["replicas"] == 1)


async def test_a_deleted_child_comes_back(cluster, operator):
    await cluster.apply(example("llama-8b-disaggregated"))
    await eventually(lambda: phase(cluster, "llama-8b-split") == "Ready")
    old = cluster.child("Deployment", "llama-8b-split-decode")

    cluster.workloads.set_ready(NAMESPACE, "llama-8b-split-decode", 0)  # new pods load
    await cluster.api.delete(DEPLOYMENTS, NAMESPACE, "llama-8b-split-decode")
    # No decoder serves: an outage, not a rollout (it read RollingOut, then PodsStarting,
    # Degraded never said).
    await eventually(lambda: phase(cluster, "llama-8b-split") == "Degraded")
    status = cluster.model("llama-8b-split")["status"]
    assert status["reason"] == "ReplicasUnavailable" and "decode lost pods" in status["message"]

    def recreated() -> bool:
        new = cluster.child("Deployment", "llama-8b-split-decode")
        return new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]

    await eventually(recreated, what="the decode Deployment recreated")
    new = cluster.child("Deployment", "llama-8b-split-decode")
    assert server_free(new) == server_free(old), "recreated as it was, replicas included"
    await eventually(lambda: cluster.events("DriftRepaired"), what="a DriftRepaired Event")
    assert phase(cluster, "llama-8b-split") == "Degraded"  # until its pods are ready
    cluster.workloads.set_ready(NAMESPACE, "llama-8b-split-decode", None)
    await eventually(lambda: phase(cluster, "llama-8b-split") == "Ready")


async def test_a_mode_change_keeps_the_old_role_serving_until_the_new_ones_are_ready(
    cluster, operator
):
    await cluster.apply(normal())
    await eventually(lambda: phase(cluster, "m") == "Ready", what="Ready")
    for role in ("prefill", "decode"):  # loading the model: minutes
        cluster.workloads.set_ready(NAMESPACE, f"m-{role}", 0)
    split = {"mode": "Disaggregated", "normal": None, "prefill": {}, "decode": {}}
    await cluster.patch_model("m", {"spec": split})

    await eventually(lambda: cluster.child("Deployment", "m-decode"), what="the new roles")
    await asyncio.sleep(0.6)  # a few passes
    assert cluster.child("Deployment", "m-normal") and cluster.pods("m", "normal")
    assert phase(cluster, "m") == "Progressing"  # the normal pods serve meanwhile

    cluster.workloads.set_ready(NAMESPACE, "m-prefill", None)
    await asyncio.sleep(0.6)  # one new role ready is not enough
    assert cluster.child("Deployment", "m-normal")
    cluster.workloads.set_ready(NAMESPACE, "m-decode", None)

    def normal_children() -> list[str]:
        return [
            c["metadata"]["name"]
            for c in cluster.children("m")
            if "-normal" in c["metadata"]["name"]
        ]

    await eventually(lambda: not normal_children(), what="the normal role's children gone")
    await eventually(lambda: phase(cluster, "m") == "Ready", what="Ready, split")
    # The old role went because of the spec, passes after its edit: no hand was set back.
    assert not cluster.events("DriftRepaired")
    said = "; ".join(e["message"] for e in cluster.events("SpecApplied"))
    assert "Deployment m-normal: deleted" in said and "Deployment m-decode: created" in said


async def test_hand_edits_of_owned_fields_are_set_back(cluster, operator):
    await cluster.apply(example("llama-8b-disaggregated"))
    name = "llama-8b-split-decode"
    await eventually(lambda: cluster.child("Deployment", name), what="decode Deployment")
    wanted = cluster.child("Deployment", name)["spec"]["template"]["spec"]
    containers = copy.deepcopy(wanted["containers"])
    containers[0]["image"] = "example.com/someone-elses:latest"

    await cluster.api.patch(
        DEPLOYMENTS,
        NAMESPACE,
        name,
        {
            "spec": {
                "template": {"spec": {"containers": containers, "nodeSelector": {"hand": "made"}}}
            }
        },
    )
    await cluster.api.patch(
        CHILDREN["ConfigMap"],
        NAMESPACE,
        f"{name}-engine",
        {"data": {"max-num-seqs": "1", "extra": "flag"}},
    )

    def repaired() -> bool:
        pod_spec = cluster.child("Deployment", name)["spec"]["template"]["spec"]
        data = cluster.child("ConfigMap", f"{name}-engine")["data"]
        return (
            pod_spec["containers"] == wanted["containers"]
            and "nodeSelector" not in pod_spec
            and data.get("max-num-seqs") == "256"
            and "extra" not in data
        )

    await eventually(repaired, what="image, nodeSelector and ConfigMap set back")
    (event,) = await eventually(lambda: cluster.events("DriftRepaired"), what="an Event")
    assert "containers[0].image" in event["message"]


async def test_drift_a_webhook_writes_back_is_kept_and_the_model_settles(cluster, operator):
    # A mutating webhook (Kyverno's policies for pods apply to Deployments' templates)
    # adding a toleration: each pass patched it away, the webhook put it back in the
    # same request, and the model read RollingOut for ever, with a PATCH and an Event
    # at every timer tick.
    toleration = {"key": "team", "operator": "Exists", "effect": "NoSchedule"}

    def add_toleration(deployment: dict[str, Any]) -> None:
        pod = deployment.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
        if toleration not in (pod.get("tolerations") or []):
            pod["tolerations"] = [*(pod.get("tolerations") or []), toleration]

    cluster.api.webhooks[DEPLOYMENTS] = add_toleration
    await cluster.apply(normal())
    await eventually(
        lambda: (cluster.model("m").get("status") or {}).get("phase") == "Ready", what="Ready"
    )
    (kept,) = await eventually(lambda: cluster.events("DriftKept"), what="a DriftKept Event")
    assert kept["type"] == "Warning"
    assert "Deployment m-normal: spec.template.spec.tolerations written back" in kept["message"]
    before, events = len(cluster.writes_by(operator)), len(cluster.events())
    await asyncio.sleep(2)  # timer ticks: no patch of the Deployment, no Event
    paths = [r.url.path for r in cluster.writes_by(operator)[before:]]
    assert not [p for p in paths if "/deployments/" in p or p.endswith("/events")], paths
    assert len(cluster.events()) == events
    assert (cluster.model("m").get("status") or {}).get("phase") == "Ready"
    # A spec edit is another repair: written, and the webhook's toleration kept with it.
    await cluster.patch_model("m", {"spec": {"normal": {"nodeSelector": {"pool": "gpu"}}}})

    def applied() -> bool:
        pod = cluster.child("Deployment", "m-normal")["spec"]["template"]["spec"]
        return pod.get("nodeSelector") == {"pool": "gpu"} and toleration in pod["tolerations"]

    await eventually(applied, what="the edit applied, the webhook's toleration with it")


async def test_the_crd_admission_refuses_what_its_rules_refuse(cluster):
    with pytest.raises(ApiError) as refused:
        await cluster.apply(normal(minReplicas=3, maxReplicas=1))
    assert refused.value.status == 422
    assert "minReplicas must not exceed maxReplicas" in refused.value.message


async def test_an_invalid_spec_is_reported_and_creates_nothing(cluster, operator):
    await cluster.apply(normal(minReplicas=3, maxReplicas=1), admit=False)

    await eventually(lambda: phase(cluster, "m") == "Invalid", what="phase Invalid")
    invalid = condition(cluster, "m", "Invalid")
    assert invalid["status"] == "True" and invalid["reason"] == "InvalidSpec"
    assert "minReplicas must not exceed maxReplicas" in invalid["message"]
    assert condition(cluster, "m", "Ready")["status"] == "False"
    assert cluster.children("m") == []
    (event,) = await eventually(lambda: cluster.events("InvalidSpec"), what="an Event")
    assert event["type"] == "Warning" and "minReplicas" in event["message"]


async def test_a_spec_only_the_operator_refuses_is_invalid_too(cluster, operator):
    manifest = normal(minReplicas=1)
    manifest["spec"]["engine"] = {"kvCacheMemory": "1.5"}  # a quantity, but no whole bytes
    await cluster.apply(manifest)  # the CRD's schema accepts it

    await eventually(lambda: phase(cluster, "m") == "Invalid", what="phase Invalid")
    assert "kvCacheMemory" in condition(cluster, "m", "Invalid")["message"]
    assert cluster.children("m") == []


async def test_a_redis_url_no_engine_can_read_is_invalid_and_quoted_nowhere(cluster, operator):
    # A raw / in the password reads as host:port; the engines crash-looped, and the
    # operator's queue read put redis-py's reason, half the password, in an Event.
    manifest = normal(minReplicas=1)
    manifest["spec"]["redis"] = {"url": "redis://:Secr3tHalf/otherhalf@redis:6379/0"}
    await cluster.apply(manifest)  # the CRD's pattern accepts it

    await eventually(lambda: phase(cluster, "m") == "Invalid", what="phase Invalid")
    message = condition(cluster, "m", "Invalid")["message"]
    assert message.startswith("spec.redis.url: the URL is not a Redis URL: redis://[[user]")
    assert cluster.children("m") == []
    (event,) = await eventually(lambda: cluster.events("InvalidSpec"), what="an Event")
    assert "Secr3tHalf" not in str(event) and "Secr3tHalf" not in str(cluster.model("m")["status"])


async def test_a_redis_url_with_a_password_in_the_spec_is_invalid(cluster, operator):
    # Written into the engines' env: whoever may read Deployments (more than may read
    # Secrets) saw it. The spec and the CRD said "no password: use urlSecretRef".
    manifest = normal(minReplicas=1)
    manifest["spec"]["redis"] = {"url": "redis://:Sup3rSecret@redis.shared.svc:6379/0"}
    await cluster.apply(manifest)
    await eventually(lambda: phase(cluster, "m") == "Invalid", what="phase Invalid")
    message = condition(cluster, "m", "Invalid")["message"]
    assert (
        message.startswith("spec.redis.url: the URL holds a password") and "urlSecretRef" in message
    )
    assert cluster.children("m") == [] and "Sup3rSecret" not in str(cluster.events())


async def test_an_unknown_field_in_a_verbatim_affinity_makes_the_model_invalid(cluster, operator):
    # The CRD keeps `affinity` as given; the API server's default would drop the
    # misspelt key and run the pods anywhere. The operator writes strictly.
    typo = {"nodeAfinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    await cluster.apply(normal(minReplicas=1, affinity=typo))

    await eventually(lambda: phase(cluster, "m") == "Invalid", what="phase Invalid")
    message = condition(cluster, "m", "Invalid")["message"]
    assert 'unknown field "spec.template.spec.affinity.nodeAfinity"' in message
    assert cluster.children("m") == [], "none of its children made (each checked first)"


async def test_a_child_the_api_server_refuses_makes_the_model_invalid_until_it_passes(
    cluster, operator
):
    # A rule only the API server knows (a toleration's value with Exists, a label
    # key's format) refuses the Deployment: the status says so, once.
    cluster.api.fail_next("POST", DEPLOYMENTS, status=422, reason="Invalid", times=10**6)
    await cluster.apply(normal(minReplicas=1))

    await eventually(lambda: phase(cluster, "m") == "Invalid", what="phase Invalid")
    message = condition(cluster, "m", "Invalid")["message"]
    assert "the API server refused a child object" in message and "422 Invalid" in message
    (event,) = await eventually(lambda: cluster.events("InvalidSpec"), what="an Event")
    assert event["type"] == "Warning"
    await asyncio.sleep(1.0)  # five autoscaler ticks: each refused again, none reported again
    assert len(cluster.events("InvalidSpec")) == 1

    cluster.api.clear_faults()  # as if the spec had been fixed
    await eventually(lambda: phase(cluster, "m") == "Ready", what="Ready once it passes")
    assert condition(cluster, "m", "Invalid")["status"] == "False"


async def test_an_invalid_edit_leaves_the_running_children_alone(cluster, operator):
    await cluster.apply(normal(replicas=2, minReplicas=1, maxReplicas=3))
    await eventually(lambda: phase(cluster, "m") == "Ready")
    versions = {
        c["metadata"]["name"]: c["metadata"]["resourceVersion"] for c in cluster.children("m")
    }

    await cluster.patch_model("m", {"spec": {"normal": {"maxReplicas": 1}}}, admit=False)
    await eventually(lambda: phase(cluster, "m") == "Invalid", what="phase Invalid")
    await asyncio.sleep(1.0)  # five autoscaler ticks: full passes that must change nothing
    assert {
        c["metadata"]["name"]: c["metadata"]["resourceVersion"] for c in cluster.children("m")
    } == versions

    await cluster.patch_model("m", {"spec": {"normal": {"maxReplicas": 3}}})
    await eventually(lambda: phase(cluster, "m") == "Ready", what="Ready again once fixed")
    assert condition(cluster, "m", "Invalid")["status"] == "False"


async def test_status_follows_the_readiness_of_the_pods(cluster, operator):
    cluster.workloads.set_ready(NAMESPACE, "m-normal", 0)
    await cluster.apply(normal(replicas=2, minReplicas=1, maxReplicas=3))
    await eventually(lambda: phase(cluster, "m") == "Pending", what="Pending")
    assert condition(cluster, "m", "Progressing")["status"] == "True"

    cluster.workloads.set_ready(NAMESPACE, "m-normal", 1)
    await eventually(lambda: phase(cluster, "m") == "Progressing", what="Progressing")
    assert cluster.model("m")["status"]["roles"]["normal"] == {
        "desired": 2,
        "replicas": 2,
        "ready": 1,
        "serving": 0,  # not yet all ready
    }

    cluster.workloads.set_ready(NAMESPACE, "m-normal", 2)
    await eventually(lambda: phase(cluster, "m") == "Ready", what="Ready")
    assert condition(cluster, "m", "Ready")["status"] == "True"
    assert cluster.model("m")["status"]["roles"]["normal"]["serving"] == 2

    cluster.workloads.set_ready(NAMESPACE, "m-normal", 1)
    await eventually(lambda: phase(cluster, "m") == "Degraded", what="Degraded")
    degraded = condition(cluster, "m", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ReplicasUnavailable"
    assert condition(cluster, "m", "Ready")["status"] == "False"

    cluster.workloads.set_ready(NAMESPACE, "m-normal", None)
    await eventually(lambda: phase(cluster, "m") == "Ready", what="Ready again")


async def test_an_engine_that_keeps_exiting_is_quoted_in_the_status(cluster, operator):
    cluster.workloads.set_ready(NAMESPACE, "m-normal", 0)
    await cluster.apply(normal(minReplicas=1))
    await eventually(lambda: phase(cluster, "m") == "Pending", what="Pending")
    (pod,) = cluster.pods("m", "normal")
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"
    crashed = {
        "name": "engine",
        "ready": False,
        "restartCount": 3,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {
            "terminated": {
                "exitCode": 1,
                "message": "tandem: error: model '/models/x' is no such file or directory",
            }
        },
    }
    # What the kubelet writes after the third exit.
    name = pod["metadata"]["name"]
    status = {"status": {"containerStatuses": [crashed]}}
    await cluster.api.patch(PODS, NAMESPACE, name, status, subresource="status")

    await eventually(lambda: phase(cluster, "m") == "Degraded", what="Degraded")
    degraded = condition(cluster, "m", "Degraded")
    assert degraded["reason"] == "EngineCrashLoop"
    assert "model '/models/x' is no such file or directory" in degraded["message"]

    cluster.workloads.set_ready(NAMESPACE, "m-normal", None)  # fixed: it serves
    await eventually(lambda: phase(cluster, "m") == "Ready", what="Ready once it serves")


async def test_a_cluster_wide_operator_serves_every_namespace(cluster, metrics, clock):
    await cluster.api.create(CLUSTER_PEERINGS, None, {"metadata": {"name": PEERING}})
    await cluster.start_operator(
        lambda: MetricSources(metrics, metrics), clock=clock, namespaces=()
    )
    await cluster.api.create(NAMESPACES, None, {"metadata": {"name": "team-b"}})
    manifest = normal()
    manifest["metadata"]["namespace"] = "team-b"
    await cluster.api.create(MODELS, "team-b", manifest)

    def served() -> bool:
        status = cluster.api.read(MODELS, "team-b", "m").get("status") or {}
        return status.get("phase") == "Ready"

    await eventually(served, what="a model in another namespace served")
    assert cluster.api.read(CHILDREN["Deployment"], "team-b", "m-normal") is not None


async def test_a_served_name_another_namespace_holds_is_taken(cluster, metrics, clock):
    # Both namespaces' engines would read one queue: team-b's pods, team-a's prompts.
    await cluster.api.create(CLUSTER_PEERINGS, None, {"metadata": {"name": PEERING}})
    await cluster.start_operator(
        lambda: MetricSources(metrics, metrics), clock=clock, namespaces=()
    )
    await cluster.apply(normal())  # "m" in the default namespace
    await eventually(lambda: phase(cluster, "m") == "Ready", what="the first holder")
    await cluster.api.create(NAMESPACES, None, {"metadata": {"name": "team-b"}})
    manifest = normal("other")
    manifest["metadata"]["namespace"] = "team-b"
    manifest["spec"]["model"]["servedModelName"] = "m"
    await cluster.api.create(MODELS, "team-b", manifest)

    def taken() -> dict[str, Any]:
        return cluster.api.read(MODELS, "team-b", "other").get("status") or {}

    await eventually(lambda: taken().get("reason") == "ServedNameTaken", what="taken")
    assert "served by a ModelDeployment of another namespace" in taken()["message"]
    assert cluster.api.read(CHILDREN["Deployment"], "team-b", "other-normal") is None


async def test_a_refused_move_onto_a_redis_where_the_name_is_served_keeps_both_serving(
    cluster, metrics, clock
):
    # "m" serves on its own Redis; team-b's "m" on the operator's. Moving the first onto
    # the operator's Redis is refused: older or not, it must not take team-b's name, and
    # its pods, on their own Redis still, serve on (they were scaled to zero).
    await cluster.api.create(CLUSTER_PEERINGS, None, {"metadata": {"name": PEERING}})
    await cluster.start_operator(
        lambda: MetricSources(metrics, metrics), clock=clock, namespaces=()
    )
    own = normal(minReplicas=2, maxReplicas=2)
    own["spec"]["redis"] = {"url": "redis://team-a-redis.default.svc:6379/0"}
    await cluster.apply(own)
    await eventually(lambda: phase(cluster, "m") == "Ready", what="m on its own Redis")
    await cluster.api.create(NAMESPACES, None, {"metadata": {"name": "team-b"}})
    theirs = normal(minReplicas=1)
    theirs["metadata"]["namespace"] = "team-b"
    await cluster.api.create(MODELS, "team-b", theirs)

    def status_b() -> dict[str, Any]:
        return cluster.api.read(MODELS, "team-b", "m").get("status") or {}

    await eventually(lambda: status_b().get("phase") == "Ready", what="team-b's m")

    await cluster.patch_model("m", {"spec": {"redis": None}})
    status = lambda: (cluster.model("m") or {}).get("status") or {}  # noqa: E731
    await eventually(lambda: status().get("reason") == "ServedNameTaken", what="refused")
    assert "served by a ModelDeployment of another namespace" in status()["message"]
    assert (
        "its pods serve it on the Redis of its last applied spec meanwhile" in status()["message"]
    )
    await asyncio.sleep(0.5)  # a few more passes
    deployment = cluster.child("Deployment", "m-normal")
    assert deployment["spec"]["replicas"] == 2
    env = {
        e["name"]: e.get("value")
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TANDEM_REDIS_URL"] == "redis://team-a-redis.default.svc:6379/0"
    assert status_b()["phase"] == "Ready"
    assert cluster.api.read(CHILDREN["Deployment"], "team-b", "m-normal")["spec"]["replicas"] == 1

    await cluster.patch_model("m", {"spec": {"redis": own["spec"]["redis"]}})  # moved back
    await eventually(lambda: phase(cluster, "m") == "Ready", what="m serving as before")


async def test_engine_pods_pull_with_the_specs_secrets_else_the_operators(cluster, metrics, clock):
    await cluster.start_operator(
        lambda: MetricSources(metrics, metrics),
        clock=clock,
        engine_image_pull_secrets=("regcred", "mirror"),
    )
    own = normal("own")
    own["spec"]["imagePullSecrets"] = [{"name": "team-b"}]
    await cluster.apply(normal("plain"))
    await cluster.apply(own)

    def pull_secrets(name: str) -> list[str] | None:
        deployment = cluster.child("Deployment", f"{name}-normal")
        if deployment is None:
            return None
        secrets = deployment["spec"]["template"]["spec"].get("imagePullSecrets", [])
        return [secret["name"] for secret in secrets]

    await eventually(lambda: pull_secrets("plain") == ["regcred", "mirror"], what="the default")
    await eventually(lambda: pull_secrets("own") == ["team-b"], what="the spec's, alone")
    (pod,) = await eventually(lambda: cluster.pods("own", "normal"), what="a pod")
    assert pod["spec"]["imagePullSecrets"] == [{"name": "team-b"}]

    # Taken out of the spec, the list falls back to the default; emptied, it goes.
    await cluster.patch_model("own", {"spec": {"imagePullSecrets": None}})
    await cluster.patch_model("plain", {"spec": {"imagePullSecrets": []}})
    await eventually(lambda: pull_secrets("own") == ["regcred", "mirror"], what="the default")
    await eventually(lambda: pull_secrets("plain") == [], what="no pull secrets")
    await eventually(lambda: phase(cluster, "plain") == phase(cluster, "own") == "Ready")


async def test_deleting_the_model_deletes_its_children(cluster, operator):
    await cluster.apply(example("llama-8b-disaggregated"))
    await eventually(lambda: phase(cluster, "llama-8b-split") == "Ready")
    # kopf's finalizer (its timer needs one) is there before the deletion.
    await eventually(lambda: cluster.model("llama-8b-split")["metadata"].get("finalizers"))

    await cluster.api.delete(MODELS, NAMESPACE, "llama-8b-split")

    await eventually(lambda: cluster.model("llama-8b-split") is None, what="model gone")
    await eventually(lambda: cluster.children("llama-8b-split") == [], what="children gone")
    assert cluster.api.select(PODS, NAMESPACE) == []
