"""What the API server does with a custom resource, for tests without a cluster.

Given a CRD's openAPIV3Schema and an object, in the API server's order:
apply the schema's defaults, refuse unknown fields (kubectl's strict field
validation), check the schema (jsonschema, draft 4: OpenAPI 3.0's boolean
exclusive bounds) and that no two items of an x-kubernetes-list-type map list
share their keys, then evaluate every CEL rule (x-kubernetes-validations) at
its node with cel-python, `self` bound to the value there. Only `self` is
bound (no oldSelf: these are create-time checks), and only the CEL the
Tandem CRD uses is needed: has(), ternaries, arithmetic, comparisons,
size(), startsWith(), matches().
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import celpy
import jsonschema

CEL_KEY = "x-kubernetes-validations"


def with_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """A copy of `value` with the schema's defaults filled in where fields are absent."""
    # A JSON round trip, not deepcopy: deepcopy keeps objects shared between two
    # fields shared, and one field's defaults would leak into the other.
    value = json.loads(json.dumps(value))
    _default(schema, value)
    return value


def _default(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, prop in schema.get("properties", {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                _default(prop, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for item in value.values():
                _default(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _default(schema["items"], item)


def unknown_fields(schema: Mapping[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the schema does not declare, as kubectl --validate=strict reports them."""
    found: list[str] = []
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            where = f"{path}.{name}" if path else name
            if props is not None and name in props:
                found += unknown_fields(props[name], item, where)
            elif isinstance(extra, Mapping):
                found += unknown_fields(extra, item, where)
            elif props is not None:
                found.append(f'{where}: unknown field "{where}"')
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def schema_errors(schema: Mapping[str, Any], value: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(value)
    ]


def list_key_errors(schema: Mapping[str, Any], value: Any) -> list[str]:
    """Items of an x-kubernetes-list-type map list that repeat another's keys (a Duplicate
    value to the API server, which jsonschema has no word for)."""
    errors = []
    for path, node, here in _nodes(schema, value, ""):
        if node.get("x-kubernetes-list-type") != "map" or not isinstance(here, list):
            continue
        seen = set()
        for i, item in enumerate(here):
            if not isinstance(item, dict):
                continue
            keys = json.dumps({k: item.get(k) for k in node["x-kubernetes-list-map-keys"]})
            if keys in seen:
                errors.append(f"{path}[{i}]: Duplicate value: {keys}")
            seen.add(keys)
    return errors


@functools.cache
def _program(rule: str) -> celpy.Runner:
    # celpy.Environment() raises the process's recursion limit to 2,500 for good;
    # restored, so later tests (the gateway's refusal of deep JSON) see Python's own.
    limit = sys.getrecursionlimit()
    try:
        env = celpy.Environment()
        return env.program(env.compile(rule))
    finally:
        sys.setrecursionlimit(limit)


def cel_errors(schema: Mapping[str, Any], value: Any) -> list[str]:
    """The messages of the rules that do not hold (a rule that errors counts as failing)."""
    errors = []
    for path, node, here in _nodes(schema, value, ""):
        for rule in node.get(CEL_KEY, []):
            try:
                holds = bool(_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(here)}))
            except celpy.CELEvalError as error:
                holds = False
                errors.append(f"{path or '<root>'}: {rule['rule']}: error {error}")
            if not holds:
                errors.append(f"{path or '<root>'}: {rule['message']}")
    return errors


def _nodes(
    schema: Mapping[str, Any], value: Any, path: str
) -> Iterator[tuple[str, Mapping[str, Any], Any]]:
    """(path, schema node, value) for every value present, parents first."""
    yield path, schema, value
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for name, item in value.items():
            child = props.get(name) or (extra if isinstance(extra, Mapping) else None)
            if child is not None:
                yield from _nodes(child, item, f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            yield from _nodes(schema["items"], item, f"{path}[{i}]")


def api_server_errors(schema: Mapping[str, Any], obj: Mapping[str, Any]) -> list[str]:
    """Why `kubectl apply` of `obj` fails; empty when the API server would store it.

    CEL only runs on a schema-valid object: the API server skips CEL after
    type errors, and cel-python would trip over wrong types.
    """
    defaulted = with_defaults(schema, obj)
    errors = unknown_fields(schema, defaulted) + schema_errors(schema, defaulted)
    errors += list_key_errors(schema, defaulted)
    return errors or cel_errors(schema, defaulted)
