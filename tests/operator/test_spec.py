"""The ModelDeployment spec model: defaults, camelCase aliases, round trips."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tandem.engine.config import EngineConfig
from tandem.operator.quantity import QUANTITY_PATTERN, quantity_bytes, quantity_value
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import DecodeRole, NormalRole, PrefillRole
from tandem.operator.spec import EngineSpec, Mode, ModelDeploymentSpec
from tandem.operator.validation import validate_spec
from tandem.protocol import Role

MINIMAL = {"model": {"path": "/models/m"}, "normal": {}}


def test_minimal_spec_gets_every_default():
    spec = ModelDeploymentSpec.model_validate(MINIMAL)
    assert spec.mode is Mode.NORMAL
    assert spec.image is None and spec.redis is None
    normal = spec.normal
    assert (normal.replicas, normal.min_replicas, normal.max_replicas) == (None, 1, 1)
    assert normal.initial_replicas == 1
    assert normal.data_parallel_size == 1
    assert normal.target_kv_cache_usage == 0.7
    assert normal.target_queued_tokens_per_replica == 8192
    assert (normal.tolerance, normal.scale_up_max_step, normal.scale_up_max_percent) == (
        0.1,
        4,
        100,
    )
    assert normal.scale_up_stabilization_seconds == 0
    assert normal.scale_down_stabilization_seconds == 300
    assert normal.scale_to_zero_after_seconds is None
    assert normal.scale_to_zero_after is None  # minReplicas 1: never
    assert normal.drain_timeout_seconds == 30
    assert spec.engine.dtype == "auto" and spec.engine.kv_cache_memory is None


def test_engine_defaults_are_the_engines_own():
    config = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    engine = EngineSpec()
    for name in (
        "max_num_seqs",
        "enable_chunked_prefill",
        "num_speculative_tokens",
        "prefill_attempt_interval",
        "prefill_any_attempt_interval",
        "cache_prefill_watermark",
        "block_size",
        "enable_prefix_caching",
    ):
        assert getattr(engine, name) == config[name], name
    # Left to the engine, which derives them from the model and the other settings.
    assert engine.max_model_len is None and engine.max_num_batched_tokens is None


def test_aliases_are_camel_case_and_python_names_also_work():
    by_alias = ModelDeploymentSpec.model_validate(
        {
            "model": {"huggingFace": {"id": "org/m"}, "servedModelName": "m"},
            "engine": {"maxNumBatchedTokens": 8192, "kvCacheMemory": "4Gi"},
            "mode": "Disaggregated",
            "prefill": {"targetBudgetUtilization": 0.5, "targetQueuedTokensPerReplica": 100},
            "decode": {"targetKVCacheUsage": 0.6, "scaleToZeroAfterSeconds": 60, "minReplicas": 0},
        }
    )
    assert by_alias.model.hugging_face.id == "org/m"
    assert by_alias.model.hugging_face.revision == "main"
    assert by_alias.engine.max_num_batched_tokens == 8192
    assert by_alias.decode.target_kv_cache_usage == 0.6
    assert by_alias.decode.scale_to_zero_after == 60
    dumped = by_alias.to_dict()
    assert dumped["decode"]["targetKVCacheUsage"] == 0.6
    assert dumped["model"]["huggingFace"] == {"id": "org/m", "revision": "main"}
    by_name = ModelDeploymentSpec(
        model={"path": "/m"}, normal=NormalRole(min_replicas=0, max_replicas=2)
    )
    assert by_name.normal.scale_to_zero_after == 300


def test_roles_in_mode_order_and_their_engine_roles():
    spec = ModelDeploymentSpec.model_validate(
        {"model": {"path": "/m"}, "mode": "Disaggregated", "decode": {}, "prefill": {}}
    )
    assert list(spec.roles()) == [RoleName.PREFILL, RoleName.DECODE]
    assert RoleName.PREFILL.engine_role is Role.PROMPT
    assert RoleName.DECODE.engine_role is Role.COMPLETION
    assert RoleName.NORMAL.engine_role is Role.NORMAL


def test_image_pull_secrets_take_the_pod_spec_form_and_an_empty_list_stays():
    assert ModelDeploymentSpec.model_validate(MINIMAL).image_pull_secrets is None
    names = ["regcred", "registry.example.com", "a", "0-mirror-9", "x" * 253]
    raw = {**MINIMAL, "imagePullSecrets": [{"name": n} for n in names]}
    spec = ModelDeploymentSpec.model_validate(raw)
    assert [s.name for s in spec.image_pull_secrets] == names
    assert spec.to_dict()["imagePullSecrets"] == raw["imagePullSecrets"]
    # Empty is not unset: it overrides the operator's default with none (manifests.py).
    empty = ModelDeploymentSpec.model_validate({**MINIMAL, "imagePullSecrets": []})
    assert empty.image_pull_secrets == [] and empty.to_dict()["imagePullSecrets"] == []


def test_served_model_name_defaults_to_the_object_name():
    spec = ModelDeploymentSpec.model_validate(MINIMAL)
    assert spec.served_model_name("llama") == "llama"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mode": "Hybrid"}, "Input should be 'Normal' or 'Disaggregated'"),
        ({"normal": {"replicas": "3"}}, "valid integer"),
        ({"normal": {"replicas": True}}, "valid integer"),
        ({"normal": {"bogus": 1}}, "Extra inputs are not permitted"),
        ({"engine": {"kvCacheMemory": "4GB"}}, "not a Kubernetes quantity"),
        ({"engine": {"kvCacheMemory": "100m"}}, "not a positive whole number of bytes"),
        ({"engine": {"kvCacheMemory": "1"}}, r"'1' is too little KV cache \(1 bytes\)"),
        ({"normal": {"resources": {"limits": {"cpu": "lots"}}}}, "not a Kubernetes quantity"),
        # Turned into an int, "1e1000000" held the event loop for half a minute.
        ({"engine": {"kvCacheMemory": "1e1000000"}}, "out of a Kubernetes quantity's range"),
        ({"normal": {"resources": {"limits": {"cpu": "1e5000"}}}}, "out of a Kubernetes"),
        ({"normal": {"resources": {"limits": {"memory": "9" * 1000}}}}, r"\(1000 characters\)"),
        ({"normal": {"maxReplicas": 2**31}}, "less than or equal to 2147483647"),
        (
            {"normal": {"resources": {"limits": {"nvidia.com/gpu": "0.5"}}}},
            "limits.nvidia.com/gpu: an extended resource must be a whole number, got '0.5'",
        ),
        # Secret names are DNS-1123 subdomains; the message says what one is.
        ({"imagePullSecrets": [{"name": "RegCred"}]}, "'RegCred' is not a Secret name: a "),
        ({"redis": {"urlSecretRef": {"name": "Redis_URL"}}}, "'Redis_URL' is not a Secret name"),
        (
            {"model": {"huggingFace": {"id": "org/m", "tokenSecretName": "HF token"}}},
            "'HF token' is not a Secret name",
        ),
        ({"imagePullSecrets": [{"name": "reg_cred"}]}, "'reg_cred' is not a Secret name"),
        ({"imagePullSecrets": [{"name": "regcred-"}]}, "'regcred-' is not a Secret name"),
        ({"imagePullSecrets": [{"name": "a..b"}]}, "each part between dots starts and ends"),
        ({"imagePullSecrets": [{"name": ""}]}, "at least 1 character"),
        ({"imagePullSecrets": [{"name": "x" * 254}]}, "at most 253 characters"),
        ({"imagePullSecrets": [{"name": "r"}, {"name": "r"}]}, "Secret 'r' is listed twice"),
        # The pod-spec form only: a bare name, or a namespace (pods use their own), is refused.
        ({"imagePullSecrets": ["regcred"]}, "valid dictionary"),
        ({"imagePullSecrets": [{"name": "r", "namespace": "x"}]}, r"Secrets\.0\.namespace"),
        ({"imagePullSecrets": {"name": "r"}}, "valid list"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(change, message):
    with pytest.raises(ValidationError, match=message):
        ModelDeploymentSpec.model_validate({**MINIMAL, **change})


def test_quantities_are_kept_as_written():
    spec = ModelDeploymentSpec.model_validate(
        {
            **MINIMAL,
            "engine": {"kvCacheMemory": "1.5Gi"},
            "normal": {"resources": {"limits": {"cpu": 4, "memory": "8Gi"}}},
        }
    )
    assert spec.engine.kv_cache_memory == "1.5Gi"
    assert quantity_bytes(spec.engine.kv_cache_memory) == 1610612736
    assert spec.to_dict()["normal"]["resources"] == {"limits": {"cpu": 4, "memory": "8Gi"}}


# Property tests: any valid spec survives dict -> model -> dict -> model unchanged.

_quantity = st.one_of(
    st.integers(min_value=1, max_value=2**40),
    st.builds(
        lambda n, unit: f"{n}{unit}", st.integers(1, 4096), st.sampled_from(["", "Ki", "Gi"])
    ),
)


def _role(extra: dict) -> st.SearchStrategy[dict]:
    # minReplicas and maxReplicas together: alone, either may cross the other's default.
    bounds = {"minReplicas": st.integers(0, 3), "maxReplicas": st.integers(3, 10)}
    common = {
        "dataParallelSize": st.integers(1, 8),
        "tolerance": st.floats(0, 0.99),
        "scaleUpMaxStep": st.integers(1, 10),
        "scaleUpStabilizationSeconds": st.integers(0, 3600),
        "scaleDownStabilizationSeconds": st.integers(0, 3600),
        "nodeSelector": st.dictionaries(st.sampled_from(["zone", "gpu"]), st.text(max_size=5)),
        "resources": st.fixed_dictionaries(
            {}, optional={"limits": st.dictionaries(st.sampled_from(["cpu", "memory"]), _quantity)}
        ),
        "affinity": st.just({"nodeAffinity": {"x": [1, {"y": "z"}]}}),
        "tolerations": st.lists(
            st.fixed_dictionaries(
                {"key": st.just("nvidia.com/gpu")},
                optional={"operator": st.sampled_from(["Exists", "Equal"])},
            ),
            max_size=2,
        ),
    }
    return st.fixed_dictionaries(bounds, optional={**common, **extra})


_engine = st.fixed_dictionaries(
    {},
    optional={
        "maxModelLen": st.integers(1, 4096),
        "maxNumSeqs": st.integers(1, 512),
        "enableChunkedPrefill": st.booleans(),
        "numSpeculativeTokens": st.integers(0, 4),
        "cachePrefillWatermark": st.floats(0.75, 1.0),  # above every targetKVCacheUsage
        "blockSize": st.sampled_from([8, 16, 32]),
        "enablePrefixCaching": st.booleans(),
        "cudaGraphs": st.booleans(),
        "dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
        "kvCacheMemory": st.one_of(st.integers(2**20, 2**40), st.just("4Gi")),
    },
)
_model = st.one_of(
    st.fixed_dictionaries({"path": st.just("/m")}),
    st.fixed_dictionaries({"pvc": st.fixed_dictionaries({"claimName": st.just("c")})}),
    st.fixed_dictionaries({"huggingFace": st.fixed_dictionaries({"id": st.just("o/m")})}),
)
_kv = {"targetKVCacheUsage": st.floats(0.01, 0.7)}
_queued = {"targetQueuedTokensPerReplica": st.integers(1, 10**6)}
_specs = st.one_of(
    st.fixed_dictionaries(
        {"model": _model, "engine": _engine, "normal": _role({**_kv, **_queued})},
        optional={
            "mode": st.just("Normal"),
            "imagePullSecrets": st.lists(
                st.fixed_dictionaries({"name": st.sampled_from(["a", "b.c", "d-1"])}),
                max_size=3,
                unique_by=lambda s: s["name"],
            ),
        },
    ),
    st.fixed_dictionaries(
        {
            "model": _model,
            "engine": _engine,
            "mode": st.just("Disaggregated"),
            "prefill": _role({"targetBudgetUtilization": st.floats(0.01, 1.0), **_queued}),
            "decode": _role(_kv),
        }
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_specs)
def test_dict_model_dict_round_trip(raw):
    spec = ModelDeploymentSpec.model_validate(raw)
    dumped = spec.to_dict()
    again = ModelDeploymentSpec.model_validate(dumped)
    assert again == spec
    assert again.to_dict() == dumped
    # What was given comes back as given; what was not comes back as its default.
    for key, value in raw["engine"].items():
        assert dumped["engine"][key] == value


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 5), st.integers(1, 5), st.integers(0, 6))
def test_replica_bounds_rule(min_replicas, max_replicas, replicas):
    raw = {"minReplicas": min_replicas, "maxReplicas": max_replicas, "replicas": replicas}
    ok = min_replicas <= max_replicas and min_replicas <= replicas <= max_replicas
    for role in (NormalRole, PrefillRole, DecodeRole):
        if ok:
            assert role.model_validate(raw).initial_replicas == replicas
        else:
            with pytest.raises(ValidationError):
                role.model_validate(raw)


@pytest.mark.parametrize(
    "text", ["4Gi", "1.5Gi", "100m", "1e3", "+1k", "0.5", ".5", "5.", "2E", "2Ei", "3e-2", "7n"]
)
def test_quantities_parse_as_the_kubernetes_client_does(text):
    from kubernetes.utils import parse_quantity  # the reference; slow to import

    assert quantity_value(text) == parse_quantity(text)
    assert re.fullmatch(QUANTITY_PATTERN, text)


@pytest.mark.parametrize("text", ["4GB", "", "e3", "1.2.3", "Gi", " 1"])
def test_non_quantities_are_refused_by_the_pattern_and_the_parser(text):
    assert not re.fullmatch(QUANTITY_PATTERN, text)
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity_value(text)


def test_a_redis_url_of_a_user_without_a_password_is_valid():
    # An ACL user with nopass: no password to hide (starred in logs all the same).
    spec = {"model": {"path": "smollm2"}, "normal": {}}
    spec["redis"] = {"url": "redis://default@redis.shared.svc:6379/0"}
    assert validate_spec(spec, name="m").redis.url == spec["redis"]["url"]
