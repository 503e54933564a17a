"""The pure manifest builders: golden files for the examples, and the rules every pod follows.

Golden files (tests/operator/golden/<example>.yaml) hold the exact objects the
examples become. After an intended change, regenerate them and review the diff:

    TANDEM_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/operator/test_manifests.py
"""

from __future__ import annotations

import argparse
import base64
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.kube_version import K8S_VERSION

from tandem.engine.config import EngineConfig
from tandem.engine.service.arguments import add_arguments, check_arguments, engine_fields
from tandem.engine.service.settings import WorkerSettings
from tandem.operator.engine_flags import engine_flags
from tandem.operator.kube import KINDS
from tandem.operator.manifests import (
    CHILD_KINDS,
    DELETION_COST_ANNOTATION,
    OperatorDefaults,
    Owner,
    build_manifests,
    pod_deletion_cost_patch,
    role_manifests,
)
from tandem.operator.manifests_pods import (
    CONFIG_HASH_ANNOTATION,
    pod_security_context,
    pull_policy,
)
from tandem.operator.role_name import RoleName
from tandem.operator.spec import ModelDeploymentSpec
from tandem.operator.validation import validate_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
UPDATE_GOLDEN = os.environ.get("TANDEM_UPDATE_GOLDEN") == "1"

DEFAULTS = OperatorDefaults(
    image="ghcr.io/tandem-serving/engine:0.1.0",
    redis_url="redis://tandem-redis.tandem-system.svc:6379/0",
)
LABEL_KEYS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "serving.tandem.dev/model",
    "serving.tandem.dev/role",
}


def _load(path: Path) -> tuple[Owner, ModelDeploymentSpec]:
    obj = yaml.safe_load(path.read_text())
    name = obj["metadata"]["name"]
    owner = Owner(name=name, namespace="default", uid="0b5e7c1a-5c1e-4d3f-9a0e-000000000001")
    return owner, validate_spec(obj["spec"], name=name)


def _build(
    owner: Owner,
    spec: ModelDeploymentSpec,
    defaults: OperatorDefaults = DEFAULTS,
    **overrides: int,
) -> list[dict[str, Any]]:
    replicas = {role: r.initial_replicas for role, r in spec.roles().items()}
    replicas.update({RoleName(k): v for k, v in overrides.items()})
    return build_manifests(owner, spec, replicas, defaults)


def _spec(raw: dict[str, Any]) -> ModelDeploymentSpec:
    return validate_spec(raw, name="m")


def _pod(manifests: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (deployment,) = [
        m
        for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["labels"]["serving.tandem.dev/role"] == role
    ]
    return deployment["spec"]["template"]


class _GoldenDumper(yaml.SafeDumper):
    """Multi-line strings (the fetch script) as literal blocks, so a golden diff reads well."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_GoldenDumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar(
        "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None
    ),
)


def _render(manifests: list[dict[str, Any]]) -> str:
    return yaml.dump_all(manifests, Dumper=_GoldenDumper, sort_keys=False, width=100)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_match_their_golden_manifests(path):
    rendered = _render(_build(*_load(path)))
    golden = GOLDEN / f"{path.stem}.yaml"
    if UPDATE_GOLDEN:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file: run with TANDEM_UPDATE_GOLDEN=1 ({__doc__})"
    assert rendered == golden.read_text(), "manifests changed: see this file's docstring"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_manifest_passes_kubernetes_validate_strict(path):
    for manifest in _build(*_load(path)):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_labels_and_owner_references_on_every_object(path):
    owner, spec = _load(path)
    manifests = _build(owner, spec)
    # ConfigMap, Service, Deployment, PDB, and the Redis URL's Secret when spec.redis is unset.
    per_role = 4 + (spec.redis is None)
    assert len(manifests) == per_role * len(spec.roles())
    for manifest in manifests:
        meta = manifest["metadata"]
        assert set(meta["labels"]) >= LABEL_KEYS, meta["name"]
        assert meta["labels"]["app.kubernetes.io/name"] == "tandem-engine"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "tandem-operator"
        assert meta["labels"]["serving.tandem.dev/model"] == owner.name
        assert meta["namespace"] == owner.namespace
        (ref,) = meta["ownerReferences"]
        assert ref == {
            "apiVersion": "serving.tandem.dev/v1alpha1",
            "kind": "ModelDeployment",
            "name": owner.name,
            "uid": owner.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    kinds = {"ConfigMap", "Deployment", "PodDisruptionBudget", "Service"}
    if spec.redis is None:
        kinds.add("Secret")
    assert sorted(m["kind"] for m in manifests[:per_role]) == sorted(kinds)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_children_are_of_the_kinds_listed_and_watched_at_the_api_version_kube_uses(path):
    # The controller lists CHILD_KINDS and kopf watches them (KINDS gives where);
    # a child of another kind, or at another version, would never be repaired.
    for manifest in _build(*_load(path)):
        assert manifest["kind"] in CHILD_KINDS
        resource = KINDS[manifest["kind"]]
        group = f"{resource.group}/" if resource.group else ""
        assert manifest["apiVersion"] == f"{group}{resource.version}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_pod_is_probed_locked_down_and_drains(path):
    owner, spec = _load(path)
    manifests = _build(owner, spec)
    for role_name, role in spec.roles().items():
        template = _pod(manifests, role_name.value)
        pod = template["spec"]
        assert CONFIG_HASH_ANNOTATION in template["metadata"]["annotations"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["terminationGracePeriodSeconds"] > role.drain_timeout_seconds
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/tmp" in mounts
        (engine,) = pod["containers"]
        assert engine["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert engine["livenessProbe"]["httpGet"]["path"] == "/healthz"
        startup = engine["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
        env = {e["name"]: e for e in engine["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "TANDEM_REDIS_URL" in env
        assert f"--role={role_name.engine_role.value}" in engine["args"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_engine_pods_without_a_user_leave_the_ids_to_the_platform(path):
    # OpenShift's restricted-v2 SCC refuses fixed ids outside the namespace's range and
    # assigns its own where the pod sets none.
    owner, spec = _load(path)
    fixed = _build(owner, spec)
    platform = _build(owner, spec, replace(DEFAULTS, run_as_user=None))
    ids = {"runAsUser", "runAsGroup", "fsGroup"}
    for role_name in spec.roles():
        security = _pod(fixed, role_name.value)["spec"]["securityContext"]
        assert {key: security[key] for key in ids} == dict.fromkeys(ids, 10001)
        security = _pod(platform, role_name.value)["spec"]["securityContext"]
        assert not ids & security.keys()
        assert security["runAsNonRoot"] is True
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    for manifest in platform:
        assert kubernetes_validate.validate(manifest, K8S_VERSION, strict=True) == K8S_VERSION


@pytest.mark.parametrize("uid", [0, -1, True, "10001"])
def test_a_pod_user_that_is_not_an_id_of_at_least_one_is_refused(uid):
    with pytest.raises(ValueError, match="at least 1 or None"):
        pod_security_context(uid)


def test_engine_arguments_parse_into_the_configuration_the_spec_describes():
    owner, spec = _load(ROOT / "examples" / "llama-8b-disaggregated.yaml")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for role_name, _ in spec.roles().items():
        by_kind = {m["kind"]: m for m in role_manifests(owner, spec, role_name, 1, DEFAULTS)}
        configmap, deployment = by_kind["ConfigMap"], by_kind["Deployment"]
        args = parser.parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
        config = EngineConfig(**engine_fields(args))
        assert config.engine_type.value == role_name.engine_role.value
        assert config.max_model_len == spec.engine.max_model_len
        assert config.max_num_batched_tokens == spec.engine.max_num_batched_tokens
        assert config.num_speculative_tokens == spec.engine.num_speculative_tokens
        assert config.enable_prefix_caching is spec.engine.enable_prefix_caching
        assert args.model == "/models/llama-3.1-8b-instruct"
        assert args.served_model_name == "llama-3.1-8b-instruct"
        assert args.dtype == "bfloat16"
        assert args.redis_url  # from TANDEM_REDIS_URL or the default: never a flag
        # The ConfigMap shows exactly what the pods are given.
        assert configmap["data"]["max-model-len"] == "16384"
        assert configmap["data"]["role"] == args.role


@pytest.mark.parametrize(
    "role",
    [
        {"drainTimeoutSeconds": 0, "dataParallelSize": 64},
        {"drainTimeoutSeconds": 3600, "resources": {"limits": {"cpu": "500m"}}},
    ],
)
def test_the_spec_bounds_give_flags_the_engine_starts_with(role):
    # Parsing is not enough: a flag the engine's own checks refuse is a crash loop.
    raw = {"model": {"path": "/m"}, "normal": role}
    manifests = _build(Owner("m", "ns", "uid"), _spec(raw), normal=1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(_pod(manifests, "normal")["spec"]["containers"][0]["args"])
    check_arguments(args)
    WorkerSettings(
        role=args.role,
        model_name="m",
        engine_id="e",
        http_address="a:1",
        drain_timeout=args.drain_timeout,
        handoff_ttl=args.handoff_ttl,
        kv_fetch_timeout=args.kv_fetch_timeout,
        max_waiting=args.max_waiting,
    )


def test_a_value_that_looks_like_a_flag_reaches_the_engine_as_a_value():
    raw = {"model": {"path": "-weights", "servedModelName": "-my-model"}, "normal": {}}
    manifests = _build(Owner("m", "ns", "uid"), _spec(raw), normal=1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(_pod(manifests, "normal")["spec"]["containers"][0]["args"])
    assert (args.model, args.served_model_name) == ("-weights", "-my-model")


@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_graphs_off_reaches_the_engine_as_enforce_eager(graphs):
    raw = {"model": {"path": "/m"}, "normal": {}, "engine": {"cudaGraphs": graphs}}
    manifests = _build(Owner("m", "ns", "uid"), _spec(raw), normal=1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(_pod(manifests, "normal")["spec"]["containers"][0]["args"])
    assert args.enforce_eager is not graphs


def test_a_config_change_changes_the_pod_hash_and_nothing_else_does():
    raw = {"model": {"path": "/m"}, "normal": {"maxReplicas": 4}}
    owner = Owner("m", "ns", "uid")

    def pod_hash(
        spec_raw: dict[str, Any], replicas: int = 1, defaults: OperatorDefaults = DEFAULTS
    ) -> str:
        manifests = _build(owner, _spec(spec_raw), defaults, normal=replicas)
        return _pod(manifests, "normal")["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    base = pod_hash(raw)
    assert pod_hash(raw) == base
    assert pod_hash(raw, replicas=3) == base  # scaling is no reason to roll
    assert pod_hash({**raw, "engine": {"maxNumSeqs": 64}}) != base
    assert pod_hash({**raw, "engine": {"enableChunkedPrefill": True}}) != base
    assert pod_hash({**raw, "model": {"path": "/other"}}) != base
    # The pods read the operator's Redis URL from a Secret: a new one (a rotated
    # password) rolls them too, unless the spec names its own Redis.
    rotated = OperatorDefaults(image=DEFAULTS.image, redis_url="redis://:rotated@r:6379/0")
    assert pod_hash(raw, defaults=rotated) != base
    own = {**raw, "redis": {"urlSecretRef": {"name": "redis"}}}
    assert pod_hash(own, defaults=rotated) == pod_hash(own)


def test_data_parallel_pods_hold_the_whole_group():
    raw = {
        "model": {"path": "/m"},
        "mode": "Disaggregated",
        "prefill": {"dataParallelSize": 2},
        "decode": {"dataParallelSize": 4},
    }
    manifests = _build(Owner("m", "ns", "uid"), _spec(raw))
    assert {m["kind"] for m in manifests} == {
        "ConfigMap",
        "Secret",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
    }
    prefill = _pod(manifests, "prefill")["spec"]
    ports = [(p["name"], p["containerPort"]) for p in prefill["containers"][0]["ports"]]
    assert ports == [("http", 8100), ("kv", 8200), ("http-1", 8101), ("kv-1", 8201)]
    decode = _pod(manifests, "decode")["spec"]
    assert [p["name"] for p in decode["containers"][0]["ports"]] == [
        "http",
        "http-1",
        "http-2",
        "http-3",
    ]
    assert any(v["name"] == "shm" for v in decode["volumes"])
    args = decode["containers"][0]["args"]
    assert "--data-parallel-size=4" in args
    for manifest in manifests:
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_model_sources_become_volumes_and_the_model_flag():
    owner = Owner("m", "ns", "uid")
    path_pod = _pod(_build(owner, _spec({"model": {"path": "/m"}, "normal": {}})), "normal")
    assert not any(v["name"] == "model" for v in path_pod["spec"]["volumes"])
    assert "initContainers" not in path_pod["spec"]

    pvc = {"model": {"pvc": {"claimName": "weights", "readOnly": False}}, "normal": {}}
    pvc_pod = _pod(_build(owner, _spec(pvc)), "normal")["spec"]
    (volume,) = [v for v in pvc_pod["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": False}
    args = pvc_pod["containers"][0]["args"]
    assert "--model=/models" in args

    hf = {"model": {"huggingFace": {"id": "o/m", "revision": "abc", "tokenSecretName": "hf"}}}
    hf_pod = _pod(_build(owner, _spec({**hf, "normal": {}})), "normal")["spec"]
    (fetch,) = hf_pod["initContainers"]
    env = {e["name"]: e for e in fetch["env"]}
    assert env["HF_MODEL_ID"]["value"] == "o/m" and env["HF_MODEL_REVISION"]["value"] == "abc"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    engine_mounts = {m["name"]: m for m in hf_pod["containers"][0]["volumeMounts"]}
    assert engine_mounts["model"]["readOnly"] is True  # only the init container writes


def test_redis_url_comes_from_the_spec_a_secret_or_the_operator():
    owner = Owner("m", "ns", "uid")

    def redis_env(extra: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        raw = {"model": {"path": "/m"}, "normal": {}, **extra}
        manifests = _build(owner, _spec(raw))
        engine = _pod(manifests, "normal")["spec"]["containers"][0]
        (env,) = [e for e in engine["env"] if e["name"] == "TANDEM_REDIS_URL"]
        return env, [m for m in manifests if m["kind"] == "Secret"]

    # The operator's URL (with its password, in the chart) only ever through a Secret.
    env, (secret,) = redis_env({})
    assert "value" not in env
    assert env["valueFrom"]["secretKeyRef"] == {"name": "m-normal-redis", "key": "url"}
    assert secret["metadata"]["name"] == "m-normal-redis"
    assert secret["metadata"]["namespace"] == "ns"
    assert base64.b64decode(secret["data"]["url"]).decode() == DEFAULTS.redis_url
    env, secrets = redis_env({"redis": {"url": "redis://r:1/2"}})
    assert env["value"] == "redis://r:1/2" and not secrets
    env, secrets = redis_env({"redis": {"urlSecretRef": {"name": "redis"}}})
    assert env["valueFrom"]["secretKeyRef"] == {"name": "redis", "key": "url"} and not secrets


def test_replicas_image_and_builder_errors():
    owner = Owner("m", "ns", "uid")
    spec = _spec({"model": {"path": "/m"}, "image": "mine:1", "normal": {"maxReplicas": 9}})
    manifests = role_manifests(owner, spec, RoleName.NORMAL, 7, DEFAULTS)
    (deployment,) = [m for m in manifests if m["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 7
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "mine:1"
    with pytest.raises(ValueError, match="no replica count given for role normal"):
        build_manifests(owner, spec, {}, DEFAULTS)
    with pytest.raises(ValueError, match=r"spec\.decode is not set in Normal mode"):
        role_manifests(owner, spec, RoleName.DECODE, 1, DEFAULTS)
    with pytest.raises(ValueError, match="replicas must be at least 0"):
        role_manifests(owner, spec, RoleName.NORMAL, -1, DEFAULTS)


def test_pull_secrets_come_from_the_spec_else_the_operator_never_both():
    owner = Owner("m", "ns", "uid")
    operator_default = OperatorDefaults(
        image=DEFAULTS.image, redis_url=DEFAULTS.redis_url, image_pull_secrets=("regcred", "mirror")
    )
    split = {
        "model": {"huggingFace": {"id": "o/m"}},  # the fetch-model init container's pod too
        "mode": "Disaggregated",
        "prefill": {},
        "decode": {},
    }

    def pull_secrets(extra: dict[str, Any], defaults: OperatorDefaults) -> dict[str, Any]:
        manifests = _build(owner, _spec({**split, **extra}), defaults)
        for manifest in manifests:
            kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
        pods = {role: _pod(manifests, role)["spec"] for role in ("prefill", "decode")}
        assert all(pod["initContainers"][0]["name"] == "fetch-model" for pod in pods.values())
        return {role: pod.get("imagePullSecrets") for role, pod in pods.items()}

    defaulted = [{"name": "regcred"}, {"name": "mirror"}]
    assert pull_secrets({}, operator_default) == {"prefill": defaulted, "decode": defaulted}
    # The spec's list replaces the default whole, in its order.
    own = {"imagePullSecrets": [{"name": "team-b"}, {"name": "regcred"}]}
    mine = [{"name": "team-b"}, {"name": "regcred"}]
    assert pull_secrets(own, operator_default) == {"prefill": mine, "decode": mine}
    assert pull_secrets(own, DEFAULTS) == {"prefill": mine, "decode": mine}
    # An empty list: none, default or not; neither: none, and no empty field.
    none = {"prefill": None, "decode": None}
    assert pull_secrets({"imagePullSecrets": []}, operator_default) == none
    assert pull_secrets({}, DEFAULTS) == none


def test_pod_deletion_cost_patch():
    patch = pod_deletion_cost_patch("m-decode-abc", -5)
    assert patch == {
        "metadata": {"name": "m-decode-abc", "annotations": {DELETION_COST_ANNOTATION: "-5"}}
    }
    assert DELETION_COST_ANNOTATION == "controller.kubernetes.io/pod-deletion-cost"
    for bad in (2**31, 1.5, True):
        with pytest.raises(ValueError, match="pod deletion cost"):
            pod_deletion_cost_patch("p", bad)
    with pytest.raises(ValueError, match="pod_name"):
        pod_deletion_cost_patch("", 1)


def test_cpu_pods_get_one_thread_per_limited_core():
    def threads(resources: dict[str, Any] | None, dp: int = 1) -> str | None:
        role = {"dataParallelSize": dp, **({"resources": resources} if resources else {})}
        spec = _spec({"model": {"path": "/m"}, "normal": role})
        return engine_flags("m", spec, RoleName.NORMAL, spec.normal, "tandem").get("threads")

    assert threads({"limits": {"cpu": "3"}}) == "3"
    assert threads({"limits": {"cpu": "500m"}}) == "1"  # never 0
    assert threads({"limits": {"cpu": "8"}}, dp=2) == "4"  # per rank
    assert threads({"limits": {"cpu": "8", "nvidia.com/gpu": 1}}) is None  # GPU: torch decides
    assert threads({"requests": {"cpu": "2"}}) is None  # no limit: the pod may burst
    assert threads(None) is None


@pytest.mark.parametrize(
    ("image", "policy"),
    [
        ("engine", "Always"),
        ("engine:latest", "Always"),
        ("registry:5000/team/engine", "Always"),  # the port is not a tag
        ("engine:1.2", "IfNotPresent"),
        ("engine@sha256:" + "a" * 64, "IfNotPresent"),
        ("engine:latest@sha256:" + "a" * 64, "Always"),
    ],
)
def test_the_pull_policy_written_out_is_the_one_kubernetes_would_default_to(image, policy):
    # Written out, so a policy removed from the spec reaches the pods; the API server's
    # own default, or every Deployment made before would roll once for nothing.
    assert pull_policy(None, image) == policy
    assert pull_policy("Never", image) == "Never"
