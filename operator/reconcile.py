"""Pure reconciliation: a ModelDeployment and what exists -> what to create, patch and delete.

`plan` reads no cluster and keeps no state: given the object (spec and last
status), the children found by label, the autoscaler's counts and the time,
it returns the actions and the new status. The controller (controller.py)
does the reading and the writing around it.

Drift: a child is compared with its manifest on the fields the operator sets
(manifests.py), ignoring what the API server adds (defaults, uid, status):
every value the manifest sets must be there, lists must match item by item,
and a few fields the operator owns must be absent when the manifest leaves
them out (a removed nodeSelector). Quantities compare by value, because the
API server rewrites them ("1024Mi" comes back as "1Gi", 1 as "1").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.operator.manifests import (
    OperatorDefaults,
    Owner,
    build_manifests,
    child_name,
    pods_of,
)
from tandem.operator.pod_trouble import PodTrouble, role_trouble
from tandem.operator.quantity import quantity_value
from tandem.operator.role_spec import RoleName
from tandem.operator.spec import ModelDeploymentSpec
from tandem.operator.status import RoleCounts, invalid_status, status_patch, valid_status
from tandem.operator.validation import InvalidSpec, validate_spec

Body = Mapping[str, Any]

# Fields a manifest may leave out that must then be absent from the child too
# (merge patches only add): per kind, as paths from the object's root.
_OPTIONAL_OWNED: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "Deployment": tuple(
        ("spec", "template", "spec", key)
        for key in (
            "nodeSelector",
            "tolerations",
            "affinity",
            "initContainers",
            "imagePullSecrets",
        )
    ),
}
# Maps the operator owns whole: extra keys in the child are drift.
_EXACT: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "ConfigMap": (("data",),),
    "Secret": (("data",),),
}
_MISSING = object()


@dataclass(frozen=True)
class ChildKey:
    kind: str
    name: str


@dataclass(frozen=True)
class ChildPatch:
    """A merge patch that puts a child back to its manifest; `drift` names the fields."""

    kind: str
    name: str
    patch: dict[str, Any]
    drift: tuple[str, ...]


@dataclass(frozen=True)
class Plan:
    creates: tuple[dict[str, Any], ...] = ()
    patches: tuple[ChildPatch, ...] = ()
    deletes: tuple[ChildKey, ...] = ()
    # The status merge patch; None when the status is already right.
    status: dict[str, Any] | None = None
    # Set when the spec was refused: the children are left alone.
    invalid: str | None = None

    @property
    def touches_children(self) -> bool:
        return bool(self.creates or self.patches or self.deletes)


def plan(
    model: Body,
    children: Sequence[Body],
    defaults: OperatorDefaults,
    *,
    now: str,
    decisions: Mapping[RoleName, int] | None = None,
    last_scale: Mapping[str, Any] | None = None,
    pods: Sequence[Body] = (),
) -> Plan:
    """What to do so that the children and the status match the ModelDeployment `model`.

    `decisions` are the autoscaler's new counts (roles it did not change are
    left out); `last_scale` is the status.lastScale to record with them;
    `pods` are the model's engine pods, whose troubles the status quotes.
    """
    meta = model["metadata"]
    previous = model.get("status") or {}
    try:
        spec = validate_spec(model.get("spec"), name=meta["name"])
    except InvalidSpec as error:
        return Plan(
            status=status_patch(previous, invalid_status(meta, str(error), previous, now)),
            invalid=str(error),
        )
    owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    found = {ChildKey(c["kind"], c["metadata"]["name"]): c for c in children}
    replicas = role_replicas(spec, owner.name, found, previous, decisions or {})
    desired = build_manifests(owner, spec, replicas, defaults)

    creates: list[dict[str, Any]] = []
    patches: list[ChildPatch] = []
    for manifest in desired:
        key = ChildKey(manifest["kind"], manifest["metadata"]["name"])
        actual = found.get(key)
        if actual is None:
            creates.append(manifest)
            continue
        paths = drift(manifest, actual)
        if paths:
            patches.append(ChildPatch(key.kind, key.name, repair_patch(manifest, actual), paths))
    wanted = {ChildKey(m["kind"], m["metadata"]["name"]) for m in desired}
    deletes = tuple(sorted(set(found) - wanted, key=lambda k: (k.kind, k.name)))

    changed = {ChildKey(m["kind"], m["metadata"]["name"]) for m in creates}
    changed |= {ChildKey(p.kind, p.name) for p in patches}
    deployments = {r: ChildKey("Deployment", child_name(owner.name, r)) for r in spec.roles()}
    counts = {
        role_name: _counts(
            found.get(key),
            replicas[role_name],
            key in changed,
            role_trouble(pods_of(pods, role_name)),
        )
        for role_name, key in deployments.items()
    }
    new_status = valid_status(meta, counts, previous, now, last_scale)
    return Plan(
        creates=tuple(creates),
        patches=tuple(patches),
        deletes=deletes,
        status=status_patch(previous, new_status),
    )


def role_replicas(
    spec: ModelDeploymentSpec,
    name: str,
    children: Mapping[ChildKey, Body],
    status: Body,
    decisions: Mapping[RoleName, int],
) -> dict[RoleName, int]:
    """Each role's pod count, within its bounds.

    The Deployment's spec.replicas holds the autoscaler's last decision; a
    Deployment that was deleted comes back with the count the status last
    reported, and a new role starts at spec.replicas (default minReplicas).
    A changed bound re-clamps the count at once.
    """
    reported = status.get("roles") or {}
    counts: dict[RoleName, int] = {}
    for role_name, role in spec.roles().items():
        deployment = children.get(ChildKey("Deployment", child_name(name, role_name)))
        observed = (deployment or {}).get("spec", {}).get("replicas")
        if role_name in decisions:
            count = decisions[role_name]
        elif isinstance(observed, int):
            count = observed
        elif isinstance((reported.get(role_name.value) or {}).get("desired"), int):
            count = reported[role_name.value]["desired"]
        else:
            count = role.initial_replicas
        counts[role_name] = min(role.max_replicas, max(role.min_replicas, count))
    return counts


def _counts(
    deployment: Body | None, desired: int, changing: bool, trouble: PodTrouble | None
) -> RoleCounts:
    if deployment is None:
        return RoleCounts(desired=desired, rolling=True)
    status = deployment.get("status") or {}
    replicas = int(status.get("replicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    stale = int(status.get("observedGeneration") or 0) < int(
        deployment["metadata"].get("generation") or 0
    )
    stalled = any(
        (c.get("type") == "Progressing" and c.get("status") == "False")
        or (c.get("type") == "ReplicaFailure" and c.get("status") == "True")
        for c in status.get("conditions") or []
    )
    return RoleCounts(
        desired=desired,
        replicas=replicas,
        ready=int(status.get("readyReplicas") or 0),
        rolling=changing or stale or updated < replicas,
        stalled=stalled,
        trouble=trouble,
    )


# ------------------------------------------------------------------ drift


def drift(desired: Body, actual: Body) -> tuple[str, ...]:
    """The fields where `actual` differs from the manifest `desired` (empty: none)."""
    found = _differences(
        {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")},
        actual,
        "",
    )
    kind = desired.get("kind", "")
    for path in _OPTIONAL_OWNED.get(kind, ()):
        if _get(desired, path) is _MISSING and _get(actual, path) is not _MISSING:
            found.append(".".join(path))
    for path in _EXACT.get(kind, ()):
        extra = set(_mapping(_get(actual, path))) - set(_mapping(_get(desired, path)))
        found.extend(f"{'.'.join(path)}.{key}" for key in sorted(extra))
    return tuple(found)


def refused(model: Body, error: str, *, now: str) -> Plan:
    """The plan once the API server refused a child the spec builds: Invalid, in its words.

    The spec passed the CRD and the operator's checks, so only a rule the API
    server alone knows (a GPU count that must be whole, a label key's format)
    stands in the way; retrying cannot help, a changed spec can.
    """
    meta, previous = model["metadata"], model.get("status") or {}
    why = f"the API server refused a child object: {error}"
    return Plan(
        status=status_patch(previous, invalid_status(meta, why, previous, now)), invalid=why
    )


def repair_patch(desired: Body, actual: Body) -> dict[str, Any]:
    """A merge patch that sets every owned field of `actual` back to `desired`."""
    patch: dict[str, Any] = {
        "metadata": {
            "labels": dict(desired["metadata"].get("labels", {})),
            "ownerReferences": list(desired["metadata"].get("ownerReferences", [])),
        }
    }
    for key, value in desired.items():
        if key not in ("apiVersion", "kind", "metadata", "status"):
            patch[key] = value
    kind = desired.get("kind", "")
    for path in _OPTIONAL_OWNED.get(kind, ()):
        if _get(desired, path) is _MISSING and _get(actual, path) is not _MISSING:
            _set(patch, path, None)
    for path in _EXACT.get(kind, ()):
        for extra in set(_mapping(_get(actual, path))) - set(_mapping(_get(desired, path))):
            _set(patch, (*path, extra), None)
    return patch


def _differences(desired: Any, actual: Any, path: str) -> list[str]:
    if actual is _MISSING and _dropped_when_stored(desired):
        return []  # the API server never keeps it: "repairing" it would never end
    if isinstance(desired, Mapping):
        if not isinstance(actual, Mapping):
            return [path or "."]
        found: list[str] = []
        for key, value in desired.items():
            found += _differences(value, actual.get(key, _MISSING), f"{path}.{key}".lstrip("."))
        return found
    if isinstance(desired, list):
        if not isinstance(actual, list) or len(actual) != len(desired):
            return [path]
        found = []
        for index, (want, have) in enumerate(zip(desired, actual, strict=True)):
            found += _differences(want, have, f"{path}[{index}]")
        return found
    if actual is _MISSING:
        return [path]
    if _is_quantity(path):
        try:
            return [] if quantity_value(desired) == quantity_value(actual) else [path]
        except ValueError:
            return [path]
    return [] if desired == actual and type(desired) is type(actual) else [path]


def _dropped_when_stored(value: Any) -> bool:
    """Whether the API server stores nothing for this value: Go's omitempty drops
    empty strings, lists and maps, false and 0 (and a map of nothing but those)."""
    if isinstance(value, Mapping):
        return all(_dropped_when_stored(v) for v in value.values())
    if isinstance(value, list):
        return not value
    return value is None or value is False or value == "" or (type(value) is int and value == 0)


def _is_quantity(path: str) -> bool:
    return ".resources.limits." in path or ".resources.requests." in path


def _get(obj: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _set(obj: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        obj = obj.setdefault(key, {})
    obj[path[-1]] = value


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
