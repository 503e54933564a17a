"""docs/modeldeployment.md, rendered from the generated CRD schema (so from the spec model).

One table per object (field, type, default, checks, description), then every
CEL rule with its message, the status, and the `kubectl get md` columns. The
prose that is not about one field lives in OVERVIEW below.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

OVERVIEW = """\
## What the operator makes of it

Per role (`normal`, or `prefill` and `decode`), all owned by the
ModelDeployment (deleted with it) and labelled
`app.kubernetes.io/{name=tandem-engine,instance=<name>,component=<role>}`:

- a **Deployment** `<name>-<role>` whose pods run
  `tandem engine --role normal|prompt|completion`. The replica count is the
  autoscaler's; the spec gives the bounds and the start (`replicas`: an edit
  of it is a new start).
  A data-parallel group (`dataParallelSize` N) is N rank processes inside one
  pod that vote on every step over localhost, so one pod holds the whole group
  (and N times the GPUs of one rank): a Deployment of such pods is exact, and
  no StatefulSet or cross-pod rendezvous is needed. Rank r serves HTTP on
  8100 + r (and KV on 8200 + r); probes check rank 0.
- a headless **Service** `<name>-<role>` (ports `http` 8100 and, for prefill,
  `kv` 8200, plus one pair per further rank), for discovery and scraping;
  clients never call engines directly (they go through the gateway and Redis).
- a **ConfigMap** `<name>-<role>-engine` holding the engine flags, one key per
  flag. The pods get the same values as arguments, and the pod template
  carries a hash of them (`serving.tandem.dev/config-hash`), so an edit rolls
  the pods.
- a **PodDisruptionBudget** `<name>-<role>` (maxUnavailable 1).
- without `spec.redis`, a **Secret** `<name>-<role>-redis` holding the
  operator's Redis URL (password included), which the pods read through
  `secretKeyRef`, so no password shows in a Deployment.

Pods run as a non-root user on a read-only root filesystem (emptyDirs for
/tmp and the cache), get `POD_IP` (the address engines advertise for KV
transfer) and `TANDEM_REDIS_URL`, and have a termination grace period of
`drainTimeoutSeconds` + 30 s so a stopping engine finishes its requests.
Rollouts add a pod before removing one (maxSurge 1, maxUnavailable 0): serving
capacity never drops, but a rollout waits while the cluster has no room for
the extra pod (e.g. no free GPU).

Defaults: a role nobody tuned runs one pod and never scales (minReplicas =
maxReplicas = 1), because GPUs are expensive: raise maxReplicas to autoscale.
The tolerance, the scale-up limits and the scale-down window are the
HorizontalPodAutoscaler's defaults (0.1; 4 pods or 100 %; 300 s). Engine
settings default to the engine's own (`EngineConfig`), and the ones it derives
from the model (maxModelLen, maxNumBatchedTokens) are left to it.
"""


def reference_markdown(
    root: Mapping[str, Any],
    columns: list[Mapping[str, Any]],
    *,
    api_version: str,
    command: str,
) -> str:
    """The reference page for the CRD schema `root` (its openAPIV3Schema)."""
    spec = root["properties"]["spec"]
    status = root["properties"]["status"]
    parts = [
        "# ModelDeployment reference\n",
        f"<!-- Generated from operator/spec.py by `{command}`. Do not edit. -->\n",
        f"`apiVersion: {api_version}`, `kind: ModelDeployment` (short name `md`), "
        "namespaced. Examples to copy: `examples/`. The CRD: `crds/modeldeployment.yaml`.\n",
        OVERVIEW,
        "## Rules checked at `kubectl apply`\n",
        "Beyond each field's own checks (below), the API server evaluates these CEL "
        "rules; the operator re-checks the same rules and the engine's own validation, "
        "and reports a failure as phase `Invalid` with the reason.\n",
        _rules_table(root),
        "## spec\n",
        *_object_sections("spec", spec),
        "## status\n",
        "Written by the operator (status subresource).\n",
        *_object_sections("status", status),
        "## `kubectl get md` columns\n",
        _columns_table(columns),
    ]
    return "\n".join(parts)


def _rules_table(root: Mapping[str, Any]) -> str:
    rows = [
        [f"`{where}`", f"`{rule['rule']}`", rule["message"]]
        for where, node in _walk("", root)
        for rule in node.get("x-kubernetes-validations", [])
    ]
    return _table(["Where", "Rule (CEL)", "Message"], rows)


def _walk(path: str, node: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every schema node, depth first, with its path (e.g. spec.prefill.tolerations[])."""
    yield path or "(root)", node
    for name, child in node.get("properties", {}).items():
        yield from _walk(f"{path}.{name}" if path else name, child)
    if isinstance(node.get("items"), Mapping):
        yield from _walk(f"{path}[]", node["items"])


def _object_sections(path: str, node: Mapping[str, Any]) -> list[str]:
    """A table for the object at `path`, then one per object below it."""
    sections = [] if path in ("spec", "status") else [f"### {path}\n"]
    sections.append(node.get("description", "") + "\n")
    required = set(node.get("required", []))
    rows = []
    below: list[tuple[str, Mapping[str, Any]]] = []
    for name, child in node["properties"].items():
        label = f"`{name}`" + (" (required)" if name in required else "")
        rows.append([label, _type(child), _default(child), _checks(child), _describe(child)])
        element = child.get("items", child)
        if "properties" in element:
            below.append((f"{path}.{name}" + ("[]" if "items" in child else ""), element))
    sections.append(_table(["Field", "Type", "Default", "Checks", "Description"], rows))
    for child_path, child in below:
        sections.extend(_object_sections(child_path, child))
    return sections


def _type(node: Mapping[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "quantity (int or string)"
    kind = node.get("type", "any")
    if kind == "array":
        return "list of " + _type(node["items"])
    if kind == "object" and isinstance(node.get("additionalProperties"), Mapping):
        return "map of " + _type(node["additionalProperties"])
    if kind == "object" and node.get("x-kubernetes-preserve-unknown-fields"):
        return "object (free-form)"
    return kind


def _default(node: Mapping[str, Any]) -> str:
    if "default" not in node:
        return ""
    return f"`{json.dumps(node['default'])}`"


def _checks(node: Mapping[str, Any]) -> str:
    checks = []
    if "enum" in node:
        checks.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for bound, sign, strict in (("minimum", "≥", ">"), ("maximum", "≤", "<")):
        if bound in node:
            exclusive = node.get("exclusive" + bound.capitalize(), False)
            checks.append(f"{strict if exclusive else sign} {node[bound]}")
    if "minLength" in node and node["minLength"] > 1:
        checks.append(f"at least {node['minLength']} characters")
    if "maxLength" in node:
        checks.append(f"at most {node['maxLength']} characters")
    if "pattern" in node and not node.get("x-kubernetes-int-or-string"):
        checks.append(f"matches `{node['pattern']}`")
    if node.get("x-kubernetes-list-type") == "map":
        keys = ", ".join(f"`{key}`" for key in node["x-kubernetes-list-map-keys"])
        checks.append(f"each {keys} once")
    if node.get("x-kubernetes-validations"):
        checks.append("rules: see above")
    return ", ".join(checks)


def _describe(node: Mapping[str, Any]) -> str:
    return node.get("description", "")


def _columns_table(columns: list[Mapping[str, Any]]) -> str:
    rows = [
        [
            f"`{c['name']}`",
            f"`{c['jsonPath']}`",
            c["description"],
            "wide" if c.get("priority") else "",
        ]
        for c in columns
    ]
    return _table(["Column", "From", "Shows", "Only with -o wide"], rows)


def _cell(text: str) -> str:
    """Table-safe text: a `|` would end the cell, and outside code a `<name>` would
    vanish as an HTML tag (inside code, an entity would show as written)."""
    text = text.replace("|", "\\|")
    if text.startswith("`"):
        return text
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(map(_cell, cells)) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *map(line, rows)]) + "\n"
