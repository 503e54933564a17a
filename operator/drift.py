"""Drift: where a child differs from its manifest, and the merge patch that puts it back.

A child is compared with its manifest on the fields the operator sets
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
