"""Drift: where a child differs from its manifest, and the merge patch that puts it back.

A child is compared with its manifest on the fields the operator sets
(manifests.py), ignoring what the API server adds (defaults, uid, status):
every value the manifest sets must be there, lists must match item by item,
and a few fields the operator owns must be absent when the manifest leaves
them out (a removed nodeSelector). Some maps it owns whole, to any depth: a
key the spec no longer has (one nodeSelector label, an affinity branch, a
memory limit) must go from the child too, which a merge patch does only when
told (a null); on a Deployment only the keys a manifest set, which it records
(`with_owned_keys`), as kubectl apply does. Quantities compare by value,
because the API server rewrites them ("1024Mi" comes back as "1Gi", 1 as "1").
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.operator.quantity import quantity_value

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
    )
    # The pods' ids, which the operator's --engine-run-as-user none leaves out: pods that
    # kept the old ones would stay refused by OpenShift's restricted-v2 SCC.
    + tuple(
        ("spec", "template", "spec", "securityContext", key)
        for key in ("runAsUser", "runAsGroup", "fsGroup")
    ),
}
_POD = ("spec", "template", "spec")
# Maps the operator owns whole, to any depth: extra keys in the child are drift.
# "*" stands for every item of a list (the containers): a patch replaces a list
# whole, so only the maps outside lists need their extra keys nulled.
# A Deployment's are owned as kubectl apply owns fields: only the keys its
# manifest once set (recorded in OWNED_KEYS_ANNOTATION) go when the spec drops
# them; a key someone else added (a mutating webhook's default) stays, or every
# pass would remove it and the webhook put it back.
_EXACT: Mapping[str, tuple[tuple[str, ...], ...]] = {
    "ConfigMap": (("data",),),
    "Secret": (("data",),),
    # A key added to a selector makes it select no engine pod: discovery and scraping
    # through the Service break, and the budget protects nothing from a node drain.
    "Service": (("spec", "selector"),),
    "PodDisruptionBudget": (("spec", "selector"),),
    "Deployment": (
        (*_POD, "nodeSelector"),
        (*_POD, "affinity"),
        (*_POD, "containers", "*", "resources"),
    ),
}
_MISSING = object()
# On a Deployment: the key paths of its owned maps that its manifest set (JSON, below
# spec.template.spec).
OWNED_KEYS_ANNOTATION = "serving.tandem.dev/owned-keys"
_RECORDED = frozenset({"Deployment"})

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class ChildKey:
    """A child among a model's: its kind and name."""

    kind: str
    name: str


@dataclass(frozen=True)
class ChildPatch:
    """A merge patch that puts a child back to its manifest; `drift` names the fields."""

    kind: str
    name: str
    patch: dict[str, Any]
    drift: tuple[str, ...]
    # The child's metadata.generation as read: a spec patch that leaves it so changed
    # nothing (an admission webhook wrote the drift back). None: not known.
    generation: int | None = None


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
    found.extend(_dotted(extra) for extra in _owned_extras(desired, actual))
    return tuple(found)


def repair_patch(desired: Body, actual: Body) -> dict[str, Any]:
    """A merge patch that sets every owned field of `actual` back to `desired`."""
    meta = desired["metadata"]
    patch: dict[str, Any] = {
        "metadata": {
            "labels": dict(meta.get("labels", {})),
            "ownerReferences": list(meta.get("ownerReferences", [])),
        }
    }
    if "annotations" in meta:  # ours only: a merge patch leaves the others be
        patch["metadata"]["annotations"] = dict(meta["annotations"])
    for key, value in desired.items():
        if key not in ("apiVersion", "kind", "metadata", "status"):
            patch[key] = copy.deepcopy(value)  # the nulls below must not reach `desired`
    kind = desired.get("kind", "")
    for path in _OPTIONAL_OWNED.get(kind, ()):
        if _get(desired, path) is _MISSING and _get(actual, path) is not _MISSING:
            _set(patch, path, None)
    for extra in _owned_extras(desired, actual):
        # Under a list the patch's list replaces the child's whole; a map needs nulls.
        if all(isinstance(key, str) for key in extra):
            _set(patch, [str(key) for key in extra], None)
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


def with_owned_keys(manifest: Body) -> Body:
    """`manifest`, recording in an annotation the keys of its owned maps (for the kinds
    that record them): what a later manifest may remove."""
    kind = manifest.get("kind", "")
    if kind not in _RECORDED:
        return manifest
    # Below the pod template's spec, where every owned map of a Deployment is.
    paths = sorted(
        (list(p[len(_POD) :]) for path in _EXACT[kind] for p in _key_paths(manifest, path)),
        key=lambda p: [str(k) for k in p],
    )
    recorded = json.dumps(paths, separators=(",", ":"))
    meta = manifest["metadata"]
    annotations = {**meta.get("annotations", {}), OWNED_KEYS_ANNOTATION: recorded}
    return {**manifest, "metadata": {**meta, "annotations": annotations}}


def _key_paths(body: Any, path: Sequence[str]) -> list[Path]:
    """Every key path under `path` in `body` (into maps, not into lists but at "*")."""
    if "*" in path:
        star = path.index("*")
        items = _get(body, path[:star])
        if not isinstance(items, list):
            return []
        return [
            (*path[:star], index, *below)
            for index, item in enumerate(items)
            for below in _key_paths(item, path[star + 1 :])
        ]
    found: list[Path] = []

    def walk(value: Any, at: Path) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                found.append((*at, key))
                walk(inner, (*at, key))

    walk(_get(body, path), tuple(path))
    return found


def _recorded(actual: Body) -> set[Path] | None:
    """The owned keys a child's last manifest set, if it says (None: made before the
    record was kept, or the record is unreadable: every extra key counts)."""
    text = (actual.get("metadata", {}).get("annotations") or {}).get(OWNED_KEYS_ANNOTATION)
    try:
        return {(*_POD, *path) for path in json.loads(text)} if text else None
    except (TypeError, ValueError):
        return None


def _owned_extras(desired: Body, actual: Body) -> list[Path]:
    """Keys of the maps the operator owns whole that the child has and the manifest lacks
    (a map the manifest leaves out entirely is _OPTIONAL_OWNED's); of a kind that
    records its keys, only those a manifest set."""
    kind = desired.get("kind", "")
    recorded = _recorded(actual) if kind in _RECORDED else None
    return [
        extra
        for path in _EXACT.get(kind, ())
        if "*" in path or _get(desired, path) is not _MISSING
        for extra in _extra_keys(desired, actual, path)
        if recorded is None or extra in recorded
    ]


def _extra_keys(desired: Body, actual: Body, path: Sequence[str]) -> list[Path]:
    """The paths of keys `actual` has under `path` (to any depth) that `desired` lacks;
    list indices are ints."""
    if "*" not in path:
        return [(*path, *extra) for extra in _extra_below(_get(desired, path), _get(actual, path))]
    star = path.index("*")
    wanted, have = _get(desired, path[:star]), _get(actual, path[:star])
    if not isinstance(wanted, list) or not isinstance(have, list) or len(wanted) != len(have):
        return []  # a list of another length is drift already, and replaced whole
    return [
        (*path[:star], index, *extra)
        for index, (want, got) in enumerate(zip(wanted, have, strict=True))
        for extra in _extra_keys(want, got, path[star + 1 :])
    ]


def _extra_below(desired: Any, actual: Any) -> list[Path]:
    if isinstance(actual, Mapping) and (desired is _MISSING or isinstance(desired, Mapping)):
        wanted: Mapping[str, Any] = desired if isinstance(desired, Mapping) else {}
        return [
            (key, *extra)
            for key in actual
            for extra in ([()] if key not in wanted else _extra_below(wanted[key], actual[key]))
        ]
    if isinstance(desired, list) and isinstance(actual, list) and len(desired) == len(actual):
        return [
            (index, *extra)
            for index, (want, have) in enumerate(zip(desired, actual, strict=True))
            for extra in _extra_below(want, have)
        ]
    return []


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


def _dotted(path: Sequence[str | int]) -> str:
    return "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).lstrip(".")


def _get(obj: Any, path: Sequence[str | int]) -> Any:
    for key in path:
        if isinstance(key, int):
            if not isinstance(obj, list) or key >= len(obj):
                return _MISSING
        elif not isinstance(obj, Mapping) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _set(obj: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        obj = obj.setdefault(key, {})
    obj[path[-1]] = value
