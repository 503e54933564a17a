"""The Deployment of one role: its pod template, engine container and model volumes.

Why a Deployment even for data-parallel groups: `tandem engine
--data-parallel-size N` runs the N ranks as processes of ONE pod that vote
over gloo (NCCL on GPUs) on localhost. A pod is the whole group, replicas are
independent groups, and no pod needs a stable identity or a peer's address,
so a StatefulSet would add ordering and naming nothing uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.operator.engine_flags import (
    ENGINE_CONTAINER,
    HTTP_PORT,
    HUGGING_FACE_DIR,
    KV_PORT,
    MODELS_DIR,
    config_hash,
    engine_arguments,
)
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import RoleSpec
from tandem.operator.spec import ModelDeploymentSpec

CONFIG_HASH_ANNOTATION = "serving.tandem.dev/config-hash"
CACHE_DIR = "/cache"
# Model loading may take long (a 70B model from network storage); the probe
# budget covers it so the kubelet never kills a pod that is still loading.
STARTUP_PROBE_PERIOD_SECONDS = 10
STARTUP_PROBE_FAILURES = 180  # 30 minutes
# Seconds between the engine's drain deadline and the kubelet's SIGKILL.
GRACE_MARGIN_SECONDS = 30

# The init container that downloads spec.model.huggingFace into the model volume.
# Only the files the engine loads (no .bin, .pt, ONNX or GGUF duplicates).
FETCH_SCRIPT = """\
import os, sys
try:
    from huggingface_hub import snapshot_download
except ImportError:
    sys.exit("this image has no huggingface_hub, which spec.model.huggingFace needs")
path = snapshot_download(
    repo_id=os.environ["HF_MODEL_ID"],
    revision=os.environ["HF_MODEL_REVISION"],
    local_dir=os.environ["MODEL_DIR"],
    allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"],
)
print("fetched", os.environ["HF_MODEL_ID"], "into", path)
"""


def deployment(
    *,
    metadata: dict[str, Any],
    selector: Mapping[str, str],
    spec: ModelDeploymentSpec,
    role_name: RoleName,
    role: RoleSpec,
    replicas: int,
    image: str,
    image_pull_secrets: Sequence[str],
    redis_env: dict[str, Any],
    flags: Mapping[str, str],
    run_as_user: int | None,
    redis_secret: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The role's Deployment with `replicas` pods (the autoscaler's number, not the spec's).

    `run_as_user` is the pods' user (None: the platform's, see pod_security_context);
    `redis_secret` is the data of the operator's Redis Secret when the pods read it.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be at least 0, got {replicas}")
    pod_labels = dict(metadata["labels"])
    annotations = {
        CONFIG_HASH_ANNOTATION: config_hash(flags, redis_secret),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(HTTP_PORT),
        "prometheus.io/path": "/metrics",
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(selector)},
            # Add a pod before removing one: serving capacity never drops in a rollout.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": STARTUP_PROBE_PERIOD_SECONDS * STARTUP_PROBE_FAILURES + 300,
            "template": {
                "metadata": {"labels": pod_labels, "annotations": annotations},
                "spec": _pod_spec(
                    spec, role_name, role, image, image_pull_secrets, redis_env, flags, run_as_user
                ),
            },
        },
    }


def _pod_spec(
    spec: ModelDeploymentSpec,
    role_name: RoleName,
    role: RoleSpec,
    image: str,
    image_pull_secrets: Sequence[str],
    redis_env: dict[str, Any],
    flags: Mapping[str, str],
    run_as_user: int | None,
) -> dict[str, Any]:
    volumes, mounts = _volumes(spec, role)
    pod: dict[str, Any] = {
        # Engines never call the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": role.drain_timeout_seconds + GRACE_MARGIN_SECONDS,
        "securityContext": pod_security_context(run_as_user),
    }
    if image_pull_secrets:
        # The pod's, so the fetch-model init container (same image) pulls with them too.
        pod["imagePullSecrets"] = [{"name": name} for name in image_pull_secrets]
    if spec.model.hugging_face is not None:
        pod["initContainers"] = [_fetch_container(spec, image)]
    pod["containers"] = [_engine_container(spec, role_name, role, image, redis_env, flags, mounts)]
    pod["volumes"] = volumes
    if role.node_selector:
        pod["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        pod["tolerations"] = [t.to_dict() for t in role.tolerations]
    if role.affinity:
        pod["affinity"] = dict(role.affinity)
    return pod


def pod_security_context(run_as_user: int | None) -> dict[str, Any]:
    """Non-root, with the runtime's seccomp profile. `run_as_user` fixes user, group and
    fsGroup; None sets none, for a platform that assigns them: OpenShift's restricted-v2
    SCC refuses a pod with ids outside its namespace's range, and fills them in itself."""
    if run_as_user is not None and (type(run_as_user) is not int or run_as_user < 1):
        raise ValueError(
            f"run_as_user must be a user id of at least 1 or None, got {run_as_user!r}"
        )
    ids = (
        {}
        if run_as_user is None
        else dict.fromkeys(("runAsUser", "runAsGroup", "fsGroup"), run_as_user)
    )
    return {
        "runAsNonRoot": True,
        **ids,
        # Without this the kubelet chowns every file of a model volume at each mount
        # (an fsGroup the platform assigns included).
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _engine_container(
    spec: ModelDeploymentSpec,
    role_name: RoleName,
    role: RoleSpec,
    image: str,
    redis_env: dict[str, Any],
    flags: Mapping[str, str],
    mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "command": ["tandem", "engine"],
        "args": engine_arguments(flags),
        "ports": container_ports(role_name, role),
        "env": [
            # The address the engine advertises to peers (KV transfer, registry).
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            redis_env,
            {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
        ],
        "resources": role.resources.to_dict() if role.resources else {},
        "startupProbe": _probe(
            "/healthz",
            period=STARTUP_PROBE_PERIOD_SECONDS,
            failures=STARTUP_PROBE_FAILURES,
        ),
        "readinessProbe": _probe("/readyz", period=5, failures=2),
        "livenessProbe": _probe("/healthz", period=10, failures=6),
        # A crash's last log lines (the engine's `tandem: error: ...`) become its
        # termination message, which the operator quotes in the model's status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
        "volumeMounts": mounts,
        "imagePullPolicy": pull_policy(spec.image_pull_policy, image),
    }
    return container


def pull_policy(policy: str | None, image: str) -> str:
    """The spec's policy, else the one Kubernetes would default to, written out: a policy
    removed from the spec must reach the pods, and a default the API server fills in
    is not the operator's to repair."""
    if policy is not None:
        return policy
    # As the API server reads it: the tag of the last path part; none and no digest
    # is "latest" (repo@sha256:... has no tag; repo:latest@sha256:... does).
    named, _, digest = image.partition("@")
    tag = named.rsplit("/", 1)[-1].partition(":")[2] or ("" if digest else "latest")
    return "Always" if tag == "latest" else "IfNotPresent"


def container_ports(role_name: RoleName, role: RoleSpec) -> list[dict[str, Any]]:
    """One HTTP port per rank, and one KV port per rank on prefill pods (only they serve KV)."""
    ports = []
    for rank in range(role.data_parallel_size):
        suffix = f"-{rank}" if rank else ""
        ports.append({"name": f"http{suffix}", "containerPort": HTTP_PORT + rank})
        if role_name is RoleName.PREFILL:
            ports.append({"name": f"kv{suffix}", "containerPort": KV_PORT + rank})
    for port in ports:
        port["protocol"] = "TCP"
    return ports


def _fetch_container(spec: ModelDeploymentSpec, image: str) -> dict[str, Any]:
    source = spec.model.hugging_face
    if source is None:
        raise ValueError("spec.model.huggingFace is not set")
    env: list[dict[str, Any]] = [
        {"name": "HF_MODEL_ID", "value": source.id},
        {"name": "HF_MODEL_REVISION", "value": source.revision},
        {"name": "MODEL_DIR", "value": HUGGING_FACE_DIR},
        # The Hub client's own cache and lock files; the root filesystem is read-only.
        {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    ]
    if source.token_secret_name is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": source.token_secret_name, "key": "token"}},
            }
        )
    container: dict[str, Any] = {
        "name": "fetch-model",
        "image": image,
        "command": ["python", "-c", FETCH_SCRIPT],
        "env": env,
        "resources": {
            "requests": {"cpu": "500m", "memory": "512Mi"},
            "limits": {"memory": "2Gi"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",  # as the engine's
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "model", "mountPath": MODELS_DIR},
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
        ],
        "imagePullPolicy": pull_policy(spec.image_pull_policy, image),
    }
    return container


def _volumes(
    spec: ModelDeploymentSpec, role: RoleSpec
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the engine's mounts: scratch space and the model."""
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]
    if role.data_parallel_size > 1:
        # Rank processes share tensors and NCCL buffers through /dev/shm, which a
        # container otherwise caps at 64 MiB.
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    source = spec.model
    if source.pvc is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {
                    "claimName": source.pvc.claim_name,
                    "readOnly": source.pvc.read_only,
                },
            }
        )
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": source.pvc.read_only})
    elif source.hugging_face is not None:
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    return volumes, mounts


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
