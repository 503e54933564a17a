"""The generated CRD: no drift, a valid structural schema, and its rules agree with validation.py.

The API server is emulated by support.crd_schema: defaults, strict field
validation, the OpenAPI schema (jsonschema) and every CEL rule (cel-python).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import kubernetes_validate
import pydantic
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from support.crd_schema import api_server_errors, cel_errors, with_defaults
from support.kube_version import K8S_VERSION

from tandem.operator import crd
from tandem.operator.validation import invalid_reason, validate_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

SCHEMA = crd.root_schema()


def test_committed_crd_is_what_the_spec_model_generates():
    committed = (ROOT / "crds" / "modeldeployment.yaml").read_text()
    assert committed == crd.crd_yaml(), f"crds/ is stale: run `{crd.CRD_COMMAND}`"


def test_committed_reference_is_what_the_spec_model_generates():
    committed = (ROOT / "docs" / "modeldeployment.md").read_text()
    assert committed == crd.reference(), f"docs/ is stale: run `{crd.REFERENCE_COMMAND}`"


def test_crd_passes_kubernetes_validate_strict():
    manifest = yaml.safe_load(crd.crd_yaml())
    assert kubernetes_validate.validate(manifest, K8S_VERSION, strict=True) == K8S_VERSION


def _schema_nodes(node: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Mapping]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _schema_nodes(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), Mapping):
            yield from _schema_nodes(node[key], f"{path}[{key}]")


def test_schema_is_structural():
    """What the API server demands of a structural schema (and what pydantic would break)."""
    for path, node in _schema_nodes(SCHEMA):
        assert "$ref" not in node and "nullable" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert "anyOf" not in node and "allOf" not in node, path
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "additionalProperties" not in node or isinstance(
            node["additionalProperties"], Mapping
        ), path
        for flag in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(flag, True) is True, path  # OpenAPI 3.0: a flag, not a bound
        if path.startswith(".spec") and path.count(".") > 1 and "[" not in path:
            assert node.get("description"), f"{path} has no description"


def test_printer_columns_and_status_subresource():
    version = crd.custom_resource_definition()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    paths = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert paths["Mode"] == ".spec.mode"
    assert paths["Phase"] == ".status.phase"
    assert paths["Normal"] == ".status.roles.normal.ready"
    assert paths["Prefill"] == ".status.roles.prefill.ready"
    assert paths["Decode"] == ".status.roles.decode.ready"
    assert paths["Age"] == ".metadata.creationTimestamp"
    names = crd.custom_resource_definition()["spec"]["names"]
    assert names["shortNames"] == ["md"] and names["plural"] == "modeldeployments"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_api_server_and_the_operator(path):
    obj = yaml.safe_load(path.read_text())
    assert api_server_errors(SCHEMA, obj) == []
    spec = validate_spec(obj["spec"], name=obj["metadata"]["name"])
    # The CRD's defaults and the model's are the same: the stored object is what
    # the operator would write back.
    defaulted = with_defaults(SCHEMA, obj)["spec"]
    assert defaulted == spec.to_dict()


def test_the_three_examples_are_there():
    assert {p.name for p in EXAMPLES} >= {
        "smollm2-cpu.yaml",
        "llama-8b-gpu.yaml",
        "llama-8b-disaggregated.yaml",
    }


def _merge(base: Any, patch: Any) -> Any:
    """RFC 7386 merge patch: dicts merge, None deletes, anything else replaces."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


NORMAL = {
    "apiVersion": "serving.tandem.dev/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "m"},
    "spec": {"model": {"path": "/m"}, "normal": {"maxReplicas": 3}},
}
SPLIT = _merge(
    NORMAL, {"spec": {"mode": "Disaggregated", "normal": None, "prefill": {}, "decode": {}}}
)

# (id, base, merge patch, who rejects: cel | schema | operator | None (valid), message)
CASES = [
    ("normal-ok", NORMAL, {}, None, ""),
    ("split-ok", SPLIT, {}, None, ""),
    ("min>max", NORMAL, {"spec": {"normal": {"minReplicas": 4}}}, "cel", "minReplicas must not"),
    ("replicas>max", NORMAL, {"spec": {"normal": {"replicas": 5}}}, "cel", "replicas must lie"),
    ("replicas<min", SPLIT, {"spec": {"decode": {"replicas": 0}}}, "cel", "replicas must lie"),
    ("negative-replicas", NORMAL, {"spec": {"normal": {"replicas": -1}}}, "schema", "minimum"),
    ("string-replicas", NORMAL, {"spec": {"normal": {"replicas": "3"}}}, "schema", "integer"),
    ("max-0", NORMAL, {"spec": {"normal": {"maxReplicas": 0}}}, "schema", "minimum of 1"),
    ("dp-0", NORMAL, {"spec": {"normal": {"dataParallelSize": 0}}}, "schema", "minimum of 1"),
    ("tolerance-1", NORMAL, {"spec": {"normal": {"tolerance": 1}}}, "schema", "maximum of 1"),
    (
        "budget<len",
        NORMAL,
        {"spec": {"engine": {"maxModelLen": 8192, "maxNumBatchedTokens": 4096}}},
        "cel",
        "maxNumBatchedTokens must be at least maxModelLen",
    ),
    (
        "budget<len-chunked",
        NORMAL,
        {
            "spec": {
                "engine": {
                    "maxModelLen": 8192,
                    "maxNumBatchedTokens": 4096,
                    "enableChunkedPrefill": True,
                }
            }
        },
        None,
        "",
    ),
    (
        "budget<decode-step",
        NORMAL,
        {
            "spec": {
                "engine": {
                    "maxNumBatchedTokens": 2,
                    "numSpeculativeTokens": 2,
                    "enableChunkedPrefill": True,
                }
            }
        },
        "cel",
        "must hold one decode step",
    ),
    (
        "watermark-1.5",
        NORMAL,
        {"spec": {"engine": {"cachePrefillWatermark": 1.5}}},
        "schema",
        "1.5",
    ),
    (
        "watermark-0",
        NORMAL,
        {"spec": {"engine": {"cachePrefillWatermark": 0}}},
        "schema",
        "minimum",
    ),
    ("watermark-1", NORMAL, {"spec": {"engine": {"cachePrefillWatermark": 1}}}, None, ""),
    ("dtype", NORMAL, {"spec": {"engine": {"dtype": "int4"}}}, "schema", "'int4' is not one of"),
    ("kv-4GB", NORMAL, {"spec": {"engine": {"kvCacheMemory": "4GB"}}}, "schema", "does not match"),
    ("kv-100m", NORMAL, {"spec": {"engine": {"kvCacheMemory": "100m"}}}, "operator", "whole num"),
    ("kv-neg", NORMAL, {"spec": {"engine": {"kvCacheMemory": "-1Gi"}}}, "operator", "positive"),
    ("kv-int", NORMAL, {"spec": {"engine": {"kvCacheMemory": 1 << 30}}}, None, ""),
    ("kv-1", NORMAL, {"spec": {"engine": {"kvCacheMemory": "1"}}}, "operator", "at least 1Mi"),
    ("kv-1023Ki", NORMAL, {"spec": {"engine": {"kvCacheMemory": "1023Ki"}}}, "operator", "1Mi"),
    ("kv-1Mi", NORMAL, {"spec": {"engine": {"kvCacheMemory": "1Mi"}}}, None, ""),
    ("mode", NORMAL, {"spec": {"mode": "Hybrid"}}, "schema", "'Hybrid' is not one of"),
    ("split-no-decode", SPLIT, {"spec": {"decode": None}}, "cel", "needs both spec.prefill"),
    ("split-no-prefill", SPLIT, {"spec": {"prefill": None}}, "cel", "needs both spec.prefill"),
    ("split-and-normal", SPLIT, {"spec": {"normal": {}}}, "cel", "spec.normal is for Normal"),
    ("normal-no-normal", NORMAL, {"spec": {"normal": None}}, "cel", "Normal mode needs"),
    ("normal-and-decode", NORMAL, {"spec": {"decode": {}}}, "cel", "are for Disaggregated"),
    (
        "two-sources",
        NORMAL,
        {"spec": {"model": {"pvc": {"claimName": "c"}}}},
        "cel",
        "exactly one source",
    ),
    ("no-source", NORMAL, {"spec": {"model": {"path": None}}}, "cel", "exactly one source"),
    (
        "pvc-abs",
        NORMAL,
        {"spec": {"model": {"path": None, "pvc": {"claimName": "c", "subPath": "/x"}}}},
        "cel",
        "relative path",
    ),
    (
        "pvc-dotdot",
        NORMAL,
        {"spec": {"model": {"path": None, "pvc": {"claimName": "c", "subPath": "a/../b"}}}},
        "cel",
        "relative path",
    ),
    (
        "pvc-dots-in-name",
        NORMAL,
        {"spec": {"model": {"path": None, "pvc": {"claimName": "c", "subPath": "a..b/m"}}}},
        None,
        "",
    ),
    (
        "hf-bad-id",
        NORMAL,
        {"spec": {"model": {"path": None, "huggingFace": {"id": "a/b/c"}}}},
        "schema",
        "does not match",
    ),
    (
        "zero-after-min-1",
        NORMAL,
        {"spec": {"normal": {"scaleToZeroAfterSeconds": 60}}},
        "cel",
        "scaleToZeroAfterSeconds only applies",
    ),
    (
        "zero-after-min-0",
        NORMAL,
        {"spec": {"normal": {"minReplicas": 0, "scaleToZeroAfterSeconds": 60}}},
        None,
        "",
    ),
    (
        "redis-both",
        NORMAL,
        {"spec": {"redis": {"url": "redis://r", "urlSecretRef": {"name": "s"}}}},
        "cel",
        "exactly one of url",
    ),
    ("redis-none", NORMAL, {"spec": {"redis": {}}}, "cel", "exactly one of url"),
    ("redis-scheme", NORMAL, {"spec": {"redis": {"url": "http://r"}}}, "schema", "does not match"),
    ("pull-policy", NORMAL, {"spec": {"imagePullPolicy": "Sometimes"}}, "schema", "not one of"),
    (
        "pull-secrets",
        NORMAL,
        {"spec": {"imagePullSecrets": [{"name": "regcred"}, {"name": "r.example.com"}]}},
        None,
        "",
    ),
    ("pull-secrets-empty", NORMAL, {"spec": {"imagePullSecrets": []}}, None, ""),
    (
        "pull-secret-name",
        NORMAL,
        {"spec": {"imagePullSecrets": [{"name": "Reg_Cred"}]}},
        "schema",
        "does not match",
    ),
    (
        "pull-secret-twice",
        NORMAL,
        {"spec": {"imagePullSecrets": [{"name": "r"}, {"name": "r"}]}},
        "schema",
        "Duplicate value",
    ),
    ("unknown-field", NORMAL, {"spec": {"normal": {"gpus": 1}}}, "schema", 'unknown field "spec'),
    (
        "prefill-target-on-decode",
        SPLIT,
        {"spec": {"decode": {"targetBudgetUtilization": 0.5}}},
        "schema",
        "unknown field",
    ),
    (
        "kv-target-at-watermark",
        NORMAL,
        {"spec": {"normal": {"targetKVCacheUsage": 0.9}}},
        "cel",
        "spec.normal.targetKVCacheUsage must be below",
    ),
    (
        "kv-target-over-lowered-watermark",
        SPLIT,
        {"spec": {"engine": {"cachePrefillWatermark": 0.6}}},
        "cel",
        "spec.decode.targetKVCacheUsage must be below",
    ),
    (
        "kv-target-below-raised-watermark",
        NORMAL,
        {"spec": {"engine": {"cachePrefillWatermark": 1}, "normal": {"targetKVCacheUsage": 0.95}}},
        None,
        "",
    ),
    (
        # Rank r runs on cuda:r: ranks 1-3 crash-looped every pod (invalid device ordinal).
        "fewer-gpus-than-ranks",
        NORMAL,
        {
            "spec": {
                "normal": {"dataParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 1}}}
            }
        },
        "operator",
        "spec.normal.resources.limits.nvidia.com/gpu: 1 for dataParallelSize 4",
    ),
    (
        "a-gpu-per-rank",
        NORMAL,
        {
            "spec": {
                "normal": {"dataParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}}}
            }
        },
        None,
        "",
    ),
    ("long-name", NORMAL, {"metadata": {"name": "m" * 56}}, "cel", "at most 55 characters"),
    ("upper-name", NORMAL, {"metadata": {"name": "Llama"}}, "cel", "start with a letter"),
    ("digit-name", NORMAL, {"metadata": {"name": "8b"}}, "cel", "start with a letter"),
    ("no-spec", NORMAL, {"spec": None}, "schema", "'spec' is a required property"),
]


@pytest.mark.parametrize(
    ("base", "patch", "who", "message"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_api_server_and_operator_agree(base, patch, who, message):
    obj = _merge(base, patch)
    server = api_server_errors(SCHEMA, obj)
    reason = invalid_reason(obj.get("spec"), name=obj["metadata"]["name"])
    if who is None:
        assert server == [] and reason is None
    elif who == "operator":  # beyond CEL: only the operator's check can see it
        assert server == []
        assert reason is not None and message in reason
    else:
        assert any(message in error for error in server), server
        assert reason is not None
        if who == "cel":  # one rule, one message, on both sides
            assert message in reason
            assert cel_errors(SCHEMA, with_defaults(SCHEMA, obj))


@settings(max_examples=80, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "minReplicas": st.integers(0, 3),
            "maxReplicas": st.integers(1, 3),
            "replicas": st.integers(0, 4),
            "scaleToZeroAfterSeconds": st.integers(1, 5),
        },
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "maxModelLen": st.sampled_from([1, 2048, 8192]),
            "maxNumBatchedTokens": st.sampled_from([1, 2, 4096, 8192]),
            "enableChunkedPrefill": st.booleans(),
            "numSpeculativeTokens": st.integers(0, 3),
        },
    ),
    st.sampled_from(["Normal", "Disaggregated"]),
    st.sets(st.sampled_from(["normal", "prefill", "decode"])),
    st.sets(st.sampled_from(["path", "pvc", "huggingFace"])),
)
def test_cel_and_python_rules_agree_on_random_specs(role, engine, mode, roles, sources):
    """The same verdict from CEL and from the Python twins, whatever the combination."""
    model = {
        "path": {"path": "/m"},
        "pvc": {"pvc": {"claimName": "c"}},
        "huggingFace": {"huggingFace": {"id": "o/m"}},
    }
    spec: dict[str, Any] = {"model": {}, "engine": engine, "mode": mode}
    for source in sources:
        spec["model"].update(model[source])
    for name in roles:
        spec[name] = role
    obj = {"apiVersion": "serving.tandem.dev/v1alpha1", "kind": "ModelDeployment"}
    obj |= {"metadata": {"name": "m"}, "spec": spec}
    server = api_server_errors(SCHEMA, obj)
    reason = invalid_reason(spec, name="m")
    assert (server == []) == (reason is None), (server, reason)
    if server:  # every value is schema-valid here, so these are CEL messages
        assert any(error.split(": ", 1)[1] in reason for error in server), (server, reason)


# Strings on which regexp flavours part: Unicode spaces, a vertical tab, non-ASCII
# digits and letters.
_FLAVOUR_PROBES = ("a", "a b", "a\u00a0b", "a\x0bb", "a\u2003b", "\u0661\u0662", "é", "Ａ", "a\nb")


def test_every_pattern_means_the_same_to_the_api_server_and_the_operator():
    # The API server matches patterns with Go's regexp (RE2's syntax: \s, \d and \w are
    # ASCII), pydantic with Rust's regex (Unicode): a pattern read two ways let a
    # ModelDeployment in that the operator then called Invalid.
    re2 = pytest.importorskip("re2", reason="google-re2 (cel-python's dependency) missing")
    patterns = {node["pattern"] for _, node in _schema_nodes(SCHEMA) if "pattern" in node}
    assert patterns  # the walk found them
    for pattern in patterns:
        operator = pydantic.TypeAdapter(Annotated[str, pydantic.StringConstraints(pattern=pattern)])
        for probe in _FLAVOUR_PROBES:
            api_server = re2.search(pattern, probe) is not None
            try:
                operator.validate_python(probe)
                accepted = True
            except pydantic.ValidationError:
                accepted = False
            assert api_server == accepted, (pattern, probe)
