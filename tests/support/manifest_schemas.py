"""Validation of rendered manifests: kubernetes-validate --strict, and custom resources too.

kubernetes-validate knows the built-in kinds of a Kubernetes release only. The
chart also makes custom resources: kopf's peering objects (validated against
the CRD in crds/kopf-peering.yaml, the one the tandem-crds chart installs) and
the Prometheus Operator's ServiceMonitor/PodMonitor (against a vendored minimal
schema, tests/helm/schemas/, since their CRDs are not ours to ship).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

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
