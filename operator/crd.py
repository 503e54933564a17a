"""The ModelDeployment CRD, generated from the spec model (operator/spec.py).

    python -m tandem.operator.crd > crds/modeldeployment.yaml
    python -m tandem.operator.crd --reference > docs/modeldeployment.md

Pydantic writes a JSON Schema (draft 2020-12, with $refs and nullable
optionals); the API server wants a structural OpenAPI v3 schema: no $ref, a
type on every node, optionals simply absent, boolean exclusive bounds. This
module does that translation and adds what only a CRD has (CEL rules at the
root, printer columns, the status subresource). Tests fail when the committed
files drift from what these functions produce.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import yaml

from tandem.operator.crd_reference import reference_markdown
from tandem.operator.spec import (
    API_VERSION,
    GROUP,
    KIND,
    NAME_RULES,
    PLURAL,
    VERSION,
    ModelDeploymentSpec,
)
from tandem.operator.spec_base import CEL_KEY
from tandem.operator.status_model import ModelDeploymentStatus

CRD_COMMAND = "python -m tandem.operator.crd > crds/modeldeployment.yaml"
REFERENCE_COMMAND = "python -m tandem.operator.crd --reference > docs/modeldeployment.md"
HEADER = f"# Generated from operator/spec.py by `{CRD_COMMAND}`. Do not edit.\n"

# Keys of a generated node in the order people read them (the rest keep pydantic's order).
_KEY_ORDER = (
    "description",
    "type",
    "format",
    "enum",
    "default",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "required",
    "properties",
    "items",
    "additionalProperties",
    CEL_KEY,
)
# JSON Schema keys with no place in a CRD schema (titles are pydantic's class names).
_DROPPED = {"title", "$defs"}
# A CEL rule's keys in reading order (pydantic sorts them alphabetically).
_RULE_KEYS = ("rule", "message", "fieldPath")


def openapi_schema(model_schema: Mapping[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema as a structural OpenAPI v3 schema (see the module docstring)."""
    defs = model_schema.get("$defs", {})
    return _structural(model_schema, defs)


def _inline(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    """The node with a $ref or an Optional's anyOf replaced by what it stands for."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        # What the field says (its description, its default) wins over the class's.
        node = {**_inline(target, defs), **node}
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b != {"type": "null"}]
        if len(branches) == 1:  # Optional[X]: absent means unset, null is never stored
            del node["anyOf"]
            node = {**_inline(branches[0], defs), **node}
            if node.get("default", ...) is None:
                del node["default"]
        else:
            node["anyOf"] = branches
    return node


def _structural(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _inline(node, defs).items():
        if key in _DROPPED or (key == "additionalProperties" and value is False):
            continue  # unknown fields are pruned by the API server, refused by pydantic
        if key == "properties":
            value = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
            value = _structural(value, defs)
        elif key == "anyOf":
            value = [_structural(branch, defs) for branch in value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # OpenAPI 3.0: the bound goes in minimum/maximum, exclusive* is a flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            value = True
        elif key == CEL_KEY:
            value = [{k: rule[k] for k in _RULE_KEYS if k in rule} for rule in value]
        out[key] = value
    if "type" not in out and "properties" in out:
        out["type"] = "object"
    order = {key: i for i, key in enumerate(_KEY_ORDER)}
    return dict(sorted(out.items(), key=lambda item: order.get(item[0], len(order))))


def spec_schema() -> dict[str, Any]:
    return openapi_schema(ModelDeploymentSpec.model_json_schema(by_alias=True))


def status_schema() -> dict[str, Any]:
    return openapi_schema(ModelDeploymentStatus.model_json_schema(by_alias=True))


def root_schema() -> dict[str, Any]:
    """The openAPIV3Schema: apiVersion, kind, metadata, spec, status, and the name rules."""
    return {
        "description": "A model served by Tandem engine pods, prefill and decode "
        "together (Normal) or split (Disaggregated). Reference: docs/modeldeployment.md.",
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        CEL_KEY: [rule.to_schema() for rule in NAME_RULES],
    }


def printer_columns() -> list[dict[str, Any]]:
    """`kubectl get md`: mode, phase, ready pods per role, why, age."""

    def column(name: str, kind: str, path: str, description: str, priority: int = 0) -> dict:
        entry = {"name": name, "type": kind, "jsonPath": path, "description": description}
        if priority:
            entry["priority"] = priority
        return entry

    return [
        column("Mode", "string", ".spec.mode", "Normal or Disaggregated"),
        column("Phase", "string", ".status.phase", "Pending, Progressing, Ready, ..."),
        column("Normal", "integer", ".status.roles.normal.ready", "Ready normal pods"),
        column("Prefill", "integer", ".status.roles.prefill.ready", "Ready prefill pods"),
        column("Decode", "integer", ".status.roles.decode.ready", "Ready decode pods"),
        column("Reason", "string", ".status.reason", "Why the phase"),
        column("Message", "string", ".status.message", "Why, at length", priority=1),
        column("Age", "date", ".metadata.creationTimestamp", "Since creation"),
    ]


def custom_resource_definition() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["md"],
                "categories": ["tandem"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                    "schema": {"openAPIV3Schema": root_schema()},
                }
            ],
        },
    }


def crd_yaml() -> str:
    """crds/modeldeployment.yaml, header comment included."""
    body = yaml.dump(
        custom_resource_definition(),
        Dumper=_PlainDumper,
        sort_keys=False,
        width=100,
        allow_unicode=True,
    )
    return HEADER + body


class _PlainDumper(yaml.SafeDumper):
    """Writes repeated values out again: anchors (&id001) would puzzle people and tools."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def reference() -> str:
    """docs/modeldeployment.md: every field, default and rule, from the generated CRD."""
    return reference_markdown(
        root_schema(), printer_columns(), api_version=API_VERSION, command=REFERENCE_COMMAND
    )


def main(argv: list[str]) -> int:
    if argv not in ([], ["--reference"]):
        print(f"usage: {CRD_COMMAND}\n       {REFERENCE_COMMAND}", file=sys.stderr)
        return 2
    sys.stdout.write(reference() if argv else crd_yaml())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
