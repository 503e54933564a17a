"""Validation of rendered manifests: kubernetes-validate --strict, and custom resources too.

kubernetes-validate knows the built-in kinds of a Kubernetes release only. The
chart also makes custom resources: kopf's peering objects (validated against
the CRD in crds/kopf-peering.yaml, the one the tandem-crds chart installs) and
the Prometheus Operator's ServiceMonitor, PodMonitor and PrometheusRule (against a vendored minimal
schema, tests/helm/schemas/, since their CRDs are not ours to ship).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
import yaml
from kubernetes_validate.utils import schema_contents

from support.kube_version import K8S_VERSION

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "tests" / "helm" / "schemas" / "monitoring.coreos.com_v1.json"


def _crd_schemas() -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd:
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                api_version = f"{spec['group']}/{version['name']}"
                yield (api_version, spec["names"]["kind"]), version["schema"]["openAPIV3Schema"]


def validate(manifest: dict[str, Any]) -> None:
    """Raise if `manifest` is not a valid object of its kind (unknown fields included)."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key[0] == "monitoring.coreos.com/v1":
        document = json.loads(MONITORING.read_text())
        schema = {**document[key[1]], "definitions": document["definitions"]}
        jsonschema.validate(manifest, schema)
        return
    custom = dict(_crd_schemas())
    if key in custom:
        # The API server checks metadata itself; the CRD's schema covers the rest.
        jsonschema.validate({k: v for k, v in manifest.items() if k != "metadata"}, custom[key])
        assert manifest["metadata"].get("name"), "a custom resource needs a name"
        return
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def unknown_fields(manifest: dict[str, Any]) -> list[str] | None:
    """The fields of a built-in object its kind does not define, as the API server's
    strict decoding names them (`spec.template.spec.containers[0].imagePolicy`); None
    for a kind kubernetes-validate has no schema for (custom resources)."""
    try:
        validator = _strict_validator(manifest["apiVersion"], manifest["kind"])
    except FileNotFoundError:
        return None
    found = []
    for error in validator.iter_errors(manifest):
        if error.validator != "additionalProperties":
            continue  # other rules are not what strict decoding adds
        known = error.schema.get("properties", {})
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        found += [f"{where}.{key}".lstrip(".") for key in error.instance if key not in known]
    return sorted(found)


@functools.cache
def _strict_validator(api_version: str, kind: str) -> jsonschema.Validator:
    # kubernetes_validate.validate stops at the first error; this finds them all.
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)  # as kubernetes_validate
    folder = f"kubernetes-json-schema/v{K8S_VERSION}.0-local-strict"
    schema = schema_contents(f"{folder}/{kind.lower()}-{group}.json", K8S_VERSION)
    definitions = schema_contents(f"{folder}/_definitions.json", K8S_VERSION)
    registry = referencing.Resource.from_contents(definitions) @ (
        referencing.Resource.from_contents(schema) @ referencing.Registry()
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)
