"""The ModelDeployment spec (serving.tandem.dev/v1alpha1): the one source of truth.

Its parts live beside it: the roles in role_spec.py, the weights' sources in
model_source.py, the shared base and rules in spec_base.py. crd.py turns these
models into the CRD's OpenAPI schema (defaults, ranges, descriptions, CEL rules)
and docs/modeldeployment.md; validation.py re-checks specs with them;
manifests.py builds the engine pods from them.

Engine defaults are read from EngineConfig, so the CRD cannot drift from the
engine it configures.
"""

from __future__ import annotations

import dataclasses
import re
from enum import StrEnum
from typing import Literal

from pydantic import Field, field_validator

from tandem.engine.config import EngineConfig
from tandem.operator.model_source import ModelSpec
from tandem.operator.quantity import KvCacheBytes
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import DecodeRole, NormalRole, PrefillRole, RoleSpec
from tandem.operator.spec_base import CelRule, SecretName, SpecModel, count_set
from tandem.redaction import check_redis_url

GROUP = "serving.tandem.dev"
VERSION = "v1alpha1"
KIND = "ModelDeployment"
PLURAL = "modeldeployments"
API_VERSION = f"{GROUP}/{VERSION}"

# Children are named <name>-<role> (longest: "-prefill"); a Service name is a
# DNS-1035 label of at most 63 characters.
MAX_NAME_LENGTH = 63 - len("-prefill")
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Rules on metadata.name, which only a rule at the CRD's root can see.
NAME_RULES = (
    CelRule(
        rule=f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        message=f"metadata.name must be at most {MAX_NAME_LENGTH} characters: "
        "child objects are named <name>-prefill and a Service name has at most 63",
        holds=lambda name: len(name) <= MAX_NAME_LENGTH,
    ),
    CelRule(
        rule=f"self.metadata.name.matches('{NAME_PATTERN}')",
        message="metadata.name must start with a letter and hold only lowercase letters, "
        "digits and '-' (it names the role Services)",
        holds=lambda name: re.fullmatch(NAME_PATTERN, name) is not None,
    ),
)

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


class Mode(StrEnum):
    NORMAL = "Normal"
    DISAGGREGATED = "Disaggregated"


class EngineSpec(SpecModel):
    """Engine settings shared by every role (`tandem engine` flags; see docs/scheduler.md)."""

    cel_rules = (
        CelRule(
            rule="!has(self.maxNumBatchedTokens) || !has(self.maxModelLen) || "
            "self.enableChunkedPrefill || self.maxNumBatchedTokens >= self.maxModelLen",
            message="maxNumBatchedTokens must be at least maxModelLen unless "
            "enableChunkedPrefill is true: a prompt of maxModelLen tokens could never be scheduled",
            holds=lambda e: (
                e.max_num_batched_tokens is None
                or e.max_model_len is None
                or e.enable_chunked_prefill
                or e.max_num_batched_tokens >= e.max_model_len
            ),
            field_path=".maxNumBatchedTokens",
        ),
        CelRule(
            rule="!has(self.maxNumBatchedTokens) || "
            "self.maxNumBatchedTokens > self.numSpeculativeTokens",
            message="maxNumBatchedTokens must hold one decode step of one sequence "
            "(1 + numSpeculativeTokens tokens)",
            holds=lambda e: (
                e.max_num_batched_tokens is None
                or e.max_num_batched_tokens > e.num_speculative_tokens
            ),
            field_path=".maxNumBatchedTokens",
        ),
    )

    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Longest sequence (prompt + output) served; default: the model's context "
        "length, capped by what the KV cache holds and, when maxNumBatchedTokens is set "
        "without chunked prefill, by that budget. More than the model's context length "
        "is refused when the engine starts.",
    )
    max_num_seqs: int = Field(
        _ENGINE_DEFAULTS["max_num_seqs"], ge=1, description="Most sequences running at once."
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of one step; default: max(maxModelLen, 4096, "
        "maxNumSeqs × (1 + numSpeculativeTokens)).",
    )
    enable_chunked_prefill: bool = Field(
        _ENGINE_DEFAULTS["enable_chunked_prefill"],
        description="Cut prompts that do not fit a step's remaining budget into chunks.",
    )
    num_speculative_tokens: int = Field(
        _ENGINE_DEFAULTS["num_speculative_tokens"],
        ge=0,
        le=16,
        description="Draft tokens verified per sequence and decode step (0: no speculation).",
    )
    prefill_attempt_interval: int = Field(
        _ENGINE_DEFAULTS["prefill_attempt_interval"],
        ge=1,
        description="Normal role: every this many decode steps, prefill if every rank wants to.",
    )
    prefill_any_attempt_interval: int = Field(
        _ENGINE_DEFAULTS["prefill_any_attempt_interval"],
        ge=1,
        description="Normal role: every this many decode steps, prefill if any rank wants to.",
    )
    cache_prefill_watermark: float = Field(
        _ENGINE_DEFAULTS["cache_prefill_watermark"],
        gt=0,
        le=1,
        description="An engine takes new prompts only while its KV cache usage is at most this.",
    )
    block_size: int = Field(
        _ENGINE_DEFAULTS["block_size"], ge=1, le=1024, description="Tokens per KV cache block."
    )
    enable_prefix_caching: bool = Field(
        _ENGINE_DEFAULTS["enable_prefix_caching"],
        description="Reuse the KV of full blocks shared with earlier prompts.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and KV dtype; auto: bfloat16 on GPUs, float32 on CPUs."
    )
    cuda_graphs: bool = Field(
        True,
        description="On GPUs, replay decode steps from CUDA graphs (false: launch every "
        "kernel of every step, the engine's --enforce-eager).",
    )
    kv_cache_memory: KvCacheBytes | None = Field(
        None,
        description="Bytes of KV cache per rank, e.g. 4Gi (at least 1Mi); default: 90 % of "
        "the GPU memory left after the weights, 1 GiB on CPUs.",
    )


class SecretKeyRef(SpecModel):
    """A key of a Secret in the ModelDeployment's namespace."""

    name: SecretName = Field(description="The Secret's name.")
    key: str = Field("url", min_length=1, max_length=253, description="The key in the Secret.")


class RedisSpec(SpecModel):
    """The Redis the gateway and engines share; default: the operator's."""

    cel_rules = (
        CelRule(
            rule="has(self.url) != has(self.urlSecretRef)",
            message="spec.redis needs exactly one of url or urlSecretRef",
            holds=lambda r: count_set(r.url, r.url_secret_ref) == 1,
        ),
    )

    url: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^(redis|rediss|unix)://",
        description="redis://host:port/db (no password: use urlSecretRef for one).",
    )
    url_secret_ref: SecretKeyRef | None = Field(
        None, description="A Secret key holding the URL (for URLs with a password)."
    )

    @field_validator("url")
    @classmethod
    def _readable_url(cls, url: str | None) -> str | None:
        """A URL the engines cannot read crash-looped every pod, and the operator's own
        read of its queue quoted redis-py's reason, half a password in it, in an Event."""
        if url is not None:
            from redis.connection import parse_url  # not at import: the simulator needs none

            check_redis_url(url, "the URL")
            if parse_url(url).keys() & {"password", "ssl_password"}:  # in the pods' env
                raise ValueError(
                    "the URL holds a password, which the engines' Deployments would show to "
                    "whoever may read them: put the URL in a Secret and give urlSecretRef"
                )
        return url


class ImagePullSecret(SpecModel):
    """A docker-registry Secret in the model's namespace, as in a pod's `imagePullSecrets`."""

    name: SecretName = Field(description="The Secret's name.")


class ModelDeploymentSpec(SpecModel):
    """One model served by Tandem engines: Normal (one role does it all) or Disaggregated."""

    cel_rules = (
        CelRule(
            rule="self.mode != 'Disaggregated' || (has(self.prefill) && has(self.decode))",
            message="Disaggregated mode needs both spec.prefill and spec.decode",
            holds=lambda s: (
                s.mode is not Mode.DISAGGREGATED or (s.prefill is not None and s.decode is not None)
            ),
        ),
        CelRule(
            rule="self.mode != 'Disaggregated' || !has(self.normal)",
            message="spec.normal is for Normal mode; Disaggregated mode uses spec.prefill "
            "and spec.decode",
            holds=lambda s: s.mode is not Mode.DISAGGREGATED or s.normal is None,
        ),
        CelRule(
            rule="self.mode != 'Normal' || has(self.normal)",
            message="Normal mode needs spec.normal",
            holds=lambda s: s.mode is not Mode.NORMAL or s.normal is not None,
        ),
        CelRule(
            rule="self.mode != 'Normal' || (!has(self.prefill) && !has(self.decode))",
            message="spec.prefill and spec.decode are for Disaggregated mode; Normal mode "
            "uses spec.normal",
            holds=lambda s: s.mode is not Mode.NORMAL or (s.prefill is None and s.decode is None),
        ),
        # Engines take no new prompts (handoffs) above the watermark, so their KV usage
        # seldom passes it: a target there would never ask for another pod.
        *(
            CelRule(
                rule=f"!has(self.{role}) || "
                f"self.{role}.targetKVCacheUsage < self.engine.cachePrefillWatermark",
                message=f"spec.{role}.targetKVCacheUsage must be below "
                "spec.engine.cachePrefillWatermark (0.9 by default): engines take no new "
                "work above the watermark, so usage would never reach the target",
                holds=lambda s, role=role: (
                    getattr(s, role) is None
                    or getattr(s, role).target_kv_cache_usage < s.engine.cache_prefill_watermark
                ),
                field_path=f".{role}.targetKVCacheUsage",
            )
            for role in ("normal", "decode")
        ),
    )

    model: ModelSpec = Field(description="The weights and the name clients ask for.")
    image: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Engine image; default: the operator's (its --engine-image setting).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        None, description="Kubernetes' default: Always for :latest, IfNotPresent otherwise."
    )
    image_pull_secrets: list[ImagePullSecret] | None = Field(
        None,
        # Keyed by name: the API server refuses a Secret listed twice.
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
        description="docker-registry Secrets, in this namespace, the engine pods pull the "
        "image with; default: the operator's (its --engine-image-pull-secret setting). A list "
        "replaces that default, not adds to it; an empty list means none. A Secret that does "
        "not exist is only a kubelet warning: the pull goes on without it.",
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        json_schema_extra={"default": {}},
        description="Engine settings shared by every role.",
    )
    mode: Mode = Field(
        Mode.NORMAL,
        strict=False,
        description="Normal: spec.normal engines prefill and decode. Disaggregated: "
        "spec.prefill engines prefill and hand the KV to spec.decode engines.",
    )
    redis: RedisSpec | None = Field(None, description="Redis; default: the operator's.")
    normal: NormalRole | None = Field(None, description="Normal mode: the engines.")
    prefill: PrefillRole | None = Field(None, description="Disaggregated mode: prefill engines.")
    decode: DecodeRole | None = Field(None, description="Disaggregated mode: decode engines.")

    @field_validator("image_pull_secrets")
    @classmethod
    def _each_secret_once(
        cls, secrets: list[ImagePullSecret] | None
    ) -> list[ImagePullSecret] | None:
        seen: set[str] = set()
        for secret in secrets or ():
            if secret.name in seen:
                raise ValueError(f"Secret {secret.name!r} is listed twice")
            seen.add(secret.name)
        return secrets

    def roles(self) -> dict[RoleName, RoleSpec]:
        """The roles this spec runs, in a stable order (prefill before decode)."""
        found = {
            RoleName.NORMAL: self.normal,
            RoleName.PREFILL: self.prefill,
            RoleName.DECODE: self.decode,
        }
        return {name: role for name, role in found.items() if role is not None}

    def served_model_name(self, name: str) -> str:
        """What clients ask for: spec.model.servedModelName, else the object's name."""
        return self.model.served_model_name or name
