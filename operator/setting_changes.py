"""Which of a pass's child changes the operator's own settings caused, not a hand edit.

Pure. A child that differs from its manifest was either edited by hand (drift,
set back: DriftRepaired) or built under settings the operator no longer has: a
new --redis-url (a password rotation), a new --engine-image or default pull
Secrets (an upgrade). Those roll the pods too, and are reported as the
operator's (SettingsApplied). To tell the two apart the children record what
they were built from: the pods' config hash covers the Redis Secret, and the
Deployment's DEFAULTS_ANNOTATION records the defaults its pods took. Where the
child as found still matches its record, nobody edited it since.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.drift import ChildKey
from tandem.operator.engine_flags import config_hash
from tandem.operator.manifests import (
    DEFAULTS_ANNOTATION,
    child_name,
    engine_config_name,
    redis_secret_name,
)
from tandem.operator.manifests_pods import CONFIG_HASH_ANNOTATION
from tandem.operator.role_name import RoleName

Body = Mapping[str, Any]
_POD = ("spec", "template", "spec")


@dataclass(frozen=True)
class SettingChange:
    """Fields of one child that change because one of the operator's settings did."""

    # The operator's flag, as its --help names it.
    setting: str
    # "Kind name", as the Events name children.
    child: str
    # Drift paths (drift.drift's) that the setting accounts for; a path ending
    # in "." or "[" covers every path that starts with it.
    paths: tuple[str, ...]

    def covers(self, child: str, path: str) -> bool:
        return child == self.child and any(
            path == mine or (mine[-1] in ".[" and path.startswith(mine)) for mine in self.paths
        )


def setting_changes(
    name: str,
    roles: tuple[RoleName, ...],
    found: Mapping[ChildKey, Body],
    wanted: Mapping[ChildKey, Body],
) -> tuple[SettingChange, ...]:
    """The changes among `found` -> `wanted` (children by key) that the operator's settings make."""
    changes: list[SettingChange] = []
    for role in roles:
        changes += _redis_url(name, role, found, wanted)
        key = ChildKey("Deployment", child_name(name, role))
        if key in found and key in wanted:
            changes += _defaults(f"Deployment {key.name}", found[key], wanted[key])
    return tuple(changes)


def _redis_url(
    name: str, role: RoleName, found: Mapping[ChildKey, Body], wanted: Mapping[ChildKey, Body]
) -> list[SettingChange]:
    """A new URL in the role's Redis Secret is the operator's --redis-url when the Secret
    as found still gives the config hash its Deployment's pods carry."""
    key = ChildKey("Secret", redis_secret_name(name, role))
    secret, manifest = found.get(key), wanted.get(key)
    config = found.get(ChildKey("ConfigMap", engine_config_name(name, role)))
    deployment = found.get(ChildKey("Deployment", child_name(name, role)))
    if secret is None or manifest is None or config is None or deployment is None:
        return []
    data = secret.get("data") or {}
    if data.get("url") == manifest["data"]["url"]:
        return []
    built = _annotations(_get(deployment, ("spec", "template"))).get(CONFIG_HASH_ANNOTATION)
    if built != config_hash(config.get("data") or {}, data):
        return []
    return [
        SettingChange("--redis-url", f"Secret {key.name}", ("data.url",)),
        SettingChange(
            "--redis-url",
            f"Deployment {child_name(name, role)}",
            (f"spec.template.metadata.annotations.{CONFIG_HASH_ANNOTATION}",),
        ),
    ]


def _defaults(child: str, actual: Body, manifest: Body) -> list[SettingChange]:
    """A default that the pods took before and take now, with another value, is the
    operator's setting when the pods as found still have the value recorded."""
    built, now = _record(actual), _record(manifest)
    if built is None or now is None:
        return []  # a Deployment from before the record: nothing to tell by
    pod = _get(actual, _POD)
    changes = []
    if _changed(built, now, "image") and _images(pod) == {built["image"]}:
        paths = ("spec.template.spec.containers[", "spec.template.spec.initContainers[")
        changes.append(SettingChange("--engine-image", child, paths))
    secrets = "imagePullSecrets"
    if _changed(built, now, secrets) and _secret_names(pod) == built[secrets]:
        paths = (_path(secrets), _path(secrets) + "[")
        changes.append(SettingChange("--engine-image-pull-secret", child, paths))
    if changes:
        path = f"metadata.annotations.{DEFAULTS_ANNOTATION}"
        changes = [SettingChange(c.setting, child, (*c.paths, path)) for c in changes]
    return changes


def _path(key: str) -> str:
    return ".".join((*_POD, key))


def _changed(built: Mapping[str, Any], now: Mapping[str, Any], key: str) -> bool:
    return key in built and key in now and built[key] != now[key]


def _record(deployment: Body) -> dict[str, Any] | None:
    """The defaults the Deployment was built with, as its annotation records them: only
    the fields of the right type (a hand-edited `"image": ["x"]` raised TypeError at every
    pass, and nothing could write the annotation right again)."""
    text = _annotations(deployment).get(DEFAULTS_ANNOTATION)
    try:
        record = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    secrets = record.get("imagePullSecrets")
    kept = {}
    if isinstance(record.get("image"), str):
        kept["image"] = record["image"]
    if isinstance(secrets, list) and all(isinstance(name, str) for name in secrets):
        kept["imagePullSecrets"] = secrets
    return kept


def _images(pod: Any) -> set[Any]:
    containers = [*(_list(pod, "initContainers")), *(_list(pod, "containers"))]
    return {c.get("image") for c in containers if isinstance(c, Mapping)}


def _secret_names(pod: Any) -> list[Any]:
    return [s.get("name") for s in _list(pod, "imagePullSecrets") if isinstance(s, Mapping)]


def _list(pod: Any, key: str) -> list[Any]:
    value = pod.get(key) if isinstance(pod, Mapping) else None
    return value if isinstance(value, list) else []


def _annotations(obj: Any) -> Mapping[str, Any]:
    annotations = _get(obj, ("metadata", "annotations"))
    return annotations if isinstance(annotations, Mapping) else {}


def _get(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, Mapping) else None
    return obj
