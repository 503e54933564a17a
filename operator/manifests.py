"""Pure builders: a validated ModelDeployment spec -> the Kubernetes objects of its roles.

Per role: a ConfigMap with the engine flags, a headless Service, the
Deployment (manifests_pods.py), a PodDisruptionBudget and, when the engines use
the operator's Redis, a Secret with its URL, all owned by the
ModelDeployment so they go when it goes. The builders read neither the
cluster nor the status: the replica count of each role is an argument (the
autoscaler's decision), so the same spec and counts always give the same
objects, which is what lets the controller repair drift by reapplying them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.operator.drift import with_owned_keys
from tandem.operator.engine_flags import engine_flags
from tandem.operator.manifests_pods import container_ports, deployment
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import RoleSpec
from tandem.operator.settings import DEFAULT_ENGINE_RUN_AS_USER
from tandem.operator.spec import API_VERSION, KIND, ModelDeploymentSpec

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
# On a role's Deployment: which of the operator's defaults its pods took
# (setting_changes.py tells an operator upgrade from a hand edit by it).
DEFAULTS_ANNOTATION = "serving.tandem.dev/operator-defaults"
# The spec.<role>.replicas a Deployment's count last took ("unset" when the spec gave
# none): an edit of it is told from the autoscaler's own moves, and applied once.
SPEC_REPLICAS_ANNOTATION = "serving.tandem.dev/spec-replicas"
# The labels of every child (`labels`). The instance and component pick a role's
# pods (`selector_labels`); MODEL_LABEL tells the watch of a child's changes which
# model to reconcile; kopf watches only the children whose MANAGED_BY_LABEL is OPERATOR.
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MODEL_LABEL = "serving.tandem.dev/model"
ROLE_LABEL = "serving.tandem.dev/role"
# The operator's name: the managed-by label of its children, the component of its Events.
OPERATOR = "tandem-operator"
# Every kind `role_manifests` builds: what the controller lists and kopf watches.
CHILD_KINDS = ("ConfigMap", "Secret", "Service", "Deployment", "PodDisruptionBudget")
Body = Mapping[str, Any]
_INT32 = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class Owner:
    """The ModelDeployment the objects belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class OperatorDefaults:
    """What the operator's settings supply when a spec leaves it out."""

    image: str
    redis_url: str
    key_prefix: str = "tandem"
    # Secret names the engine pods pull with when spec.imagePullSecrets is unset.
    image_pull_secrets: tuple[str, ...] = ()
    # The engine pods' user, group and fsGroup; None: the platform's (OpenShift).
    run_as_user: int | None = DEFAULT_ENGINE_RUN_AS_USER


def selector_labels(name: str, role_name: RoleName) -> dict[str, str]:
    """The labels that pick a role's pods; never change them (Deployment selectors are fixed)."""
    return {
        "app.kubernetes.io/name": "tandem-engine",
        INSTANCE_LABEL: name,
        COMPONENT_LABEL: role_name.value,
    }


def labels(name: str, role_name: RoleName) -> dict[str, str]:
    return {
        **selector_labels(name, role_name),
        MANAGED_BY_LABEL: OPERATOR,
        MODEL_LABEL: name,
        ROLE_LABEL: role_name.value,
    }


def pods_of(pods: Sequence[Body], role_name: RoleName) -> list[Body]:
    """The pods of one role, among a model's."""
    return [p for p in pods if p.get("metadata", {}).get("labels", {}).get(ROLE_LABEL) == role_name]


def child_name(name: str, role_name: RoleName) -> str:
    """`<name>-<role>`: the Deployment, Service and PodDisruptionBudget of a role."""
    return f"{name}-{role_name.value}"


def build_manifests(
    owner: Owner,
    spec: ModelDeploymentSpec,
    replicas: Mapping[RoleName, int],
    defaults: OperatorDefaults,
) -> list[dict[str, Any]]:
    """Every object of every role of the spec's mode; `replicas` gives each role's count."""
    manifests: list[dict[str, Any]] = []
    for role_name in spec.roles():
        if role_name not in replicas:
            raise ValueError(f"no replica count given for role {role_name.value}")
        built = role_manifests(owner, spec, role_name, replicas[role_name], defaults)
        manifests.extend(with_owned_keys(manifest) for manifest in built)
    return manifests


def role_manifests(
    owner: Owner,
    spec: ModelDeploymentSpec,
    role_name: RoleName,
    replicas: int,
    defaults: OperatorDefaults,
) -> list[dict[str, Any]]:
    """ConfigMap, Service, Deployment, PodDisruptionBudget (and Redis Secret) of one role."""
    role = spec.roles().get(role_name)
    if role is None:
        raise ValueError(f"spec.{role_name.value} is not set in {spec.mode.value} mode")
    flags = engine_flags(owner.name, spec, role_name, role, defaults.key_prefix)
    selector = selector_labels(owner.name, role_name)
    secret = _redis_secret(owner, spec, role_name, defaults)
    return [
        *([secret] if secret is not None else []),
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(owner, role_name, engine_config_name(owner.name, role_name)),
            "data": flags,
        },
        _service(owner, role_name, role, selector),
        deployment(
            metadata={
                **_metadata(owner, role_name, child_name(owner.name, role_name)),
                "annotations": {
                    DEFAULTS_ANNOTATION: _defaults_record(spec, defaults),
                    SPEC_REPLICAS_ANNOTATION: spec_replicas_record(role),
                },
            },
            selector=selector,
            spec=spec,
            role_name=role_name,
            role=role,
            replicas=replicas,
            image=spec.image or defaults.image,
            image_pull_secrets=_image_pull_secrets(spec, defaults),
            redis_env=_redis_env(spec, None if secret is None else secret["metadata"]["name"]),
            flags=flags,
            run_as_user=defaults.run_as_user,
            redis_secret=None if secret is None else secret["data"],
        ),
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, role_name, child_name(owner.name, role_name)),
            "spec": {
                "maxUnavailable": 1,
                "selector": {"matchLabels": dict(selector)},
                # A crash-looping pod protects nothing: let a node drain evict it.
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        },
    ]


def pod_deletion_cost_patch(pod_name: str, cost: int) -> dict[str, Any]:
    """A merge patch for pod `pod_name`: on scale-down the ReplicaSet removes the cheapest first.

    The autoscaler gives the least-loaded pods the lowest cost, so a scale-down
    drains the pods with the least work in flight.
    """
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise ValueError(f"pod deletion cost must be an integer, got {cost!r}")
    if not _INT32[0] <= cost <= _INT32[1]:
        raise ValueError(f"pod deletion cost must fit in 32 bits, got {cost}")
    if not pod_name:
        raise ValueError("pod_name must not be empty")
    return {"metadata": {"name": pod_name, "annotations": {DELETION_COST_ANNOTATION: str(cost)}}}


def _metadata(owner: Owner, role_name: RoleName, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner.name, role_name),
        "ownerReferences": [owner.reference()],
    }


def _service(
    owner: Owner, role_name: RoleName, role: RoleSpec, selector: Mapping[str, str]
) -> dict[str, Any]:
    """Headless: engines are found by pod address (registry, scraping), never load-balanced."""
    ports = [
        {
            "name": port["name"],
            "port": port["containerPort"],
            "targetPort": port["name"],
            "protocol": "TCP",
        }
        for port in container_ports(role_name, role)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, role_name, child_name(owner.name, role_name)),
        "spec": {
            "clusterIP": "None",
            "selector": dict(selector),
            "ports": ports,
            # Scrapers and the operator want every engine, starting ones included.
            "publishNotReadyAddresses": True,
        },
    }


def spec_replicas_record(role: RoleSpec) -> str:
    """SPEC_REPLICAS_ANNOTATION's value for a role."""
    return "unset" if role.replicas is None else str(role.replicas)


def _defaults_record(spec: ModelDeploymentSpec, defaults: OperatorDefaults) -> str:
    """DEFAULTS_ANNOTATION's value: the defaults the pods take, those the spec sets left
    out. Always written, so that a record is never stale."""
    record: dict[str, Any] = {}
    if spec.image is None:
        record["image"] = defaults.image
    if spec.image_pull_secrets is None:
        record["imagePullSecrets"] = list(defaults.image_pull_secrets)
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _image_pull_secrets(spec: ModelDeploymentSpec, defaults: OperatorDefaults) -> tuple[str, ...]:
    """The spec's list replaces the operator's default whole (an empty list: none).

    Replaced, not merged: a model that names its own registry's Secret would
    otherwise also need the default's Secret in its namespace, or get a kubelet
    warning about it on every pull.
    """
    if spec.image_pull_secrets is None:
        return defaults.image_pull_secrets
    return tuple(secret.name for secret in spec.image_pull_secrets)


def engine_config_name(name: str, role_name: RoleName) -> str:
    return f"{child_name(name, role_name)}-engine"


def redis_secret_name(name: str, role_name: RoleName) -> str:
    return f"{child_name(name, role_name)}-redis"


def _redis_secret(
    owner: Owner, spec: ModelDeploymentSpec, role_name: RoleName, defaults: OperatorDefaults
) -> dict[str, Any] | None:
    """The operator's Redis URL for a spec without spec.redis, as a Secret in its namespace.

    The URL usually carries the password (the chart's Redis has one), and a Secret in
    the operator's namespace cannot be referenced from another: so a copy, owned by
    the ModelDeployment, that only the engines' environment reads.
    """
    if spec.redis is not None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, role_name, redis_secret_name(owner.name, role_name)),
        "type": "Opaque",
        # `data`, not `stringData`: what the API server returns, so drift compares equal.
        "data": {"url": base64.b64encode(defaults.redis_url.encode()).decode()},
    }


def _redis_env(spec: ModelDeploymentSpec, default_secret: str | None) -> dict[str, Any]:
    """TANDEM_REDIS_URL, which the engine reads when no --redis-url is given.

    An environment variable, not a flag, so a URL from a Secret (password
    included) never shows in the ConfigMap, the Deployment or the process list.
    """
    name = "TANDEM_REDIS_URL"
    redis = spec.redis
    if redis is not None and redis.url_secret_ref is not None:
        ref = redis.url_secret_ref
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}
    if redis is not None and redis.url is not None:
        return {"name": name, "value": redis.url}
    if default_secret is None:
        raise ValueError("a spec without spec.redis needs the operator's Redis Secret")
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": default_secret, "key": "url"}}}
