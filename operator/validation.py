"""The operator's own check of a ModelDeployment, as it arrives from the API.

The CRD schema and its CEL rules already refused what they can at `kubectl
apply`; this re-check exists because a CRD can be older than the operator, a
cluster can skip CEL (it needs Kubernetes 1.25+), and some rules need Python:
the engine's own EngineConfig validation, per role. A failure becomes the
Invalid condition's message, so every reason names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from tandem.engine.config import EngineConfig
from tandem.operator.quantity import quantity_bytes, quantity_value
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import RoleSpec
from tandem.operator.spec import NAME_RULES, EngineSpec, ModelDeploymentSpec

# A reason lists at most this many problems: the first ones are the ones to fix first.
_MAX_PROBLEMS = 5


class InvalidSpec(ValueError):
    """A ModelDeployment that can never work; str() is the reason, naming the field."""


def validate_spec(spec: Mapping[str, Any] | None, *, name: str) -> ModelDeploymentSpec:
    """The validated spec of the ModelDeployment `name`, or InvalidSpec with the reason."""
    for rule in NAME_RULES:
        if not rule.holds(name):
            raise InvalidSpec(rule.message)
    if spec is None:
        raise InvalidSpec("spec: missing")
    try:
        parsed = ModelDeploymentSpec.model_validate(spec)
    except ValidationError as error:
        raise InvalidSpec(_reason(error)) from None
    for role_name, role in parsed.roles().items():
        try:
            engine_config(parsed.engine, role_name, role)
        except ValueError as error:
            raise InvalidSpec(f"spec.engine (for spec.{role_name}): {error}") from None
        _check_gpus_per_rank(role_name, role)
    return parsed


def _check_gpus_per_rank(role_name: RoleName, role: RoleSpec) -> None:
    """A pod's data-parallel ranks each take a GPU of its own (rank r on cuda:r): fewer
    GPUs than ranks crash-looped every pod with "invalid device ordinal"."""
    limits = (role.resources.limits if role.resources else None) or {}
    for name, amount in limits.items():
        gpus = int(quantity_value(amount))
        if name.endswith("/gpu") and 0 < gpus < role.data_parallel_size:
            raise InvalidSpec(
                f"spec.{role_name}.resources.limits.{name}: {gpus} for dataParallelSize "
                f"{role.data_parallel_size}; each rank runs on a GPU of its own: ask for at "
                f"least {role.data_parallel_size}"
            )


def invalid_reason(spec: Mapping[str, Any] | None, *, name: str) -> str | None:
    """Why the spec is invalid, or None when it is valid."""
    try:
        validate_spec(spec, name=name)
    except InvalidSpec as error:
        return str(error)
    return None


def engine_config(engine: EngineSpec, role_name: RoleName, role: RoleSpec) -> EngineConfig:
    """The EngineConfig a pod of this role builds; ValueError (the engine's words) if none.

    Without maxModelLen the engine takes the model's context length, which only
    the loaded model knows; then the smallest length stands in, so every other
    rule is still checked and the budget is compared with the model's length
    by the engine itself.
    """
    fields: dict[str, Any] = {
        "engine_type": role_name.engine_role.value,
        "max_model_len": engine.max_model_len or 1,
        "max_num_seqs": engine.max_num_seqs,
        "enable_chunked_prefill": engine.enable_chunked_prefill,
        "num_speculative_tokens": engine.num_speculative_tokens,
        "prefill_attempt_interval": engine.prefill_attempt_interval,
        "prefill_any_attempt_interval": engine.prefill_any_attempt_interval,
        "cache_prefill_watermark": engine.cache_prefill_watermark,
        "block_size": engine.block_size,
        "data_parallel_size": role.data_parallel_size,
        "enable_prefix_caching": engine.enable_prefix_caching,
    }
    if engine.max_num_batched_tokens is not None:
        fields["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if engine.kv_cache_memory is not None:
        quantity_bytes(engine.kv_cache_memory)
    return EngineConfig(**fields)


def _reason(error: ValidationError) -> str:
    """Pydantic's errors as one line: `spec.normal.minReplicas: ...; spec.mode: ...`."""
    problems = []
    for item in error.errors(include_url=False)[:_MAX_PROBLEMS]:
        where = ".".join(["spec", *(str(part) for part in item["loc"])])
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
    more = error.error_count() - len(problems)
    if more > 0:
        problems.append(f"and {more} more")
    return "; ".join(problems)
