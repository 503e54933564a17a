"""One role of a ModelDeployment (normal, prefill or decode): its pods, bounds and scaling targets.

Defaults are chosen so that a role nobody tuned runs one pod and never scales
(minReplicas = maxReplicas = 1): GPUs are expensive, so scaling out is opted
into by raising maxReplicas. The scale-up limits and the scale-down window
follow the HorizontalPodAutoscaler's defaults, which users already know.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, model_validator

from tandem.operator.quantity import Quantity, quantity_value
from tandem.operator.spec_base import CelRule, SpecModel

_INT32_MAX = 2**31 - 1


class Resources(SpecModel):
    """Compute resources of each engine pod, as in a container's `resources`.

    GPUs are `nvidia.com/gpu` (in limits). A pod with dataParallelSize N runs N
    ranks, so ask for N times the GPUs of one rank.
    """

    limits: dict[str, Quantity] | None = Field(
        None, description="Most of each resource a pod may use, e.g. cpu: 4, nvidia.com/gpu: 1."
    )
    requests: dict[str, Quantity] | None = Field(
        None, description="Resources the scheduler reserves for a pod (default: the limits)."
    )

    @model_validator(mode="after")
    def _whole_extended_resources(self) -> Resources:
        # The API server's rule for extended resources (nvidia.com/gpu and the
        # like): whole numbers. Checked here, it names the field before any pod.
        for kind, amounts in (("limits", self.limits), ("requests", self.requests)):
            for name, amount in (amounts or {}).items():
                extended = "/" in name and not name.startswith("kubernetes.io/")
                value = quantity_value(amount)
                if extended and value != value.to_integral_value():
                    raise ValueError(
                        f"{kind}.{name}: an extended resource must be a whole number, "
                        f"got {amount!r}"
                    )
        return self


class Toleration(SpecModel):
    """A toleration of the engine pods, as in a pod's `tolerations`."""

    key: str | None = Field(None, max_length=316, description="Taint key; empty with Exists.")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Default Equal.")
    value: str | None = Field(None, max_length=63, description="Taint value (Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to tolerate; empty: all effects."
    )
    toleration_seconds: int | None = Field(
        None, description="NoExecute only: seconds the pod stays bound after the taint appears."
    )


# With minReplicas 0 and no scaleToZeroAfterSeconds: the autoscaler's default
# (operator/scaling_policy.py), which matches the scale-down window's default.
DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS = 300

# Affinity is a large upstream API the operator only copies into the pods, so it is not
# re-declared here: the API server keeps it as written.
FreeFormObject = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]


class RoleSpec(SpecModel):
    """Pods of one role and how the autoscaler sizes them."""

    cel_rules = (
        CelRule(
            rule="self.minReplicas <= self.maxReplicas",
            message="minReplicas must not exceed maxReplicas",
            holds=lambda r: r.min_replicas <= r.max_replicas,
            field_path=".minReplicas",
        ),
        CelRule(
            rule="!has(self.replicas) || "
            "(self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)",
            message="replicas must lie within [minReplicas, maxReplicas]",
            holds=lambda r: r.replicas is None or r.min_replicas <= r.replicas <= r.max_replicas,
            field_path=".replicas",
        ),
        CelRule(
            rule="!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0",
            message="scaleToZeroAfterSeconds only applies with minReplicas 0",
            holds=lambda r: r.scale_to_zero_after_seconds is None or r.min_replicas == 0,
            field_path=".scaleToZeroAfterSeconds",
        ),
    )

    # A Deployment's replicas is an int32.
    replicas: int | None = Field(
        None,
        ge=0,
        le=_INT32_MAX,
        description="Pods to start with, before the autoscaler has metrics "
        "(default: minReplicas). An edit sets the count once; the autoscaler moves it "
        "from there.",
    )
    min_replicas: int = Field(
        1, ge=0, le=_INT32_MAX, description="Fewest pods; 0 lets the role scale to zero."
    )
    max_replicas: int = Field(
        1,
        ge=1,
        le=_INT32_MAX,
        description="Most pods. Equal to minReplicas (the default) means no autoscaling.",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Engine ranks per pod (`tandem engine --data-parallel-size`). The ranks are "
        "processes of one pod that vote on every step over localhost, so a pod holds the "
        "whole group: give it dataParallelSize times the GPUs of one rank.",
    )
    resources: Resources | None = Field(None, description="CPU, memory and GPUs of each pod.")
    node_selector: dict[str, str] | None = Field(
        None, description="Node labels the pods must run on."
    )
    tolerations: list[Toleration] | None = Field(
        None, description="Taints the pods tolerate (e.g. GPU nodes' taints)."
    )
    affinity: FreeFormObject | None = Field(
        None, description="A pod `affinity` (nodeAffinity, podAffinity, podAntiAffinity), verbatim."
    )
    tolerance: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="No scaling while the metric is within this fraction of its target.",
    )
    scale_up_max_step: int = Field(
        4,
        ge=1,
        description="A scale-up goes to at most this many pods more than are ready, or "
        "scaleUpMaxPercent more, whichever is larger: pods still starting use up the step.",
    )
    scale_up_max_percent: int = Field(
        100,
        ge=1,
        le=1000,
        description="A scale-up goes to at most this percentage more pods than are ready, or "
        "scaleUpMaxStep more, whichever is larger: pods still starting use up the step.",
    )
    scale_up_stabilization_seconds: int = Field(
        0,
        ge=0,
        description="A scale-up takes the lowest recommendation of this many past seconds, "
        "so a short spike adds no pods (0: at once). A role at zero always starts at once.",
    )
    scale_down_stabilization_seconds: int = Field(
        300,
        ge=0,
        description="A scale-down takes the highest recommendation of this many past seconds, "
        "so a short dip removes no pods.",
    )
    scale_to_zero_after_seconds: int | None = Field(
        None,
        ge=1,
        description="With minReplicas 0: seconds without queued or running work before the "
        f"last pod goes (unset: {DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS}). Queued work brings "
        "the role back from zero.",
    )
    drain_timeout_seconds: int = Field(
        30,
        ge=0,
        le=3600,
        description="`tandem engine --drain-timeout`: seconds a stopping engine finishes its "
        "running requests before it exits (what it still holds is taken over). The pods' "
        "termination grace period is this plus 30 s.",
    )

    @property
    def initial_replicas(self) -> int:
        return self.min_replicas if self.replicas is None else self.replicas

    @property
    def scale_to_zero_after(self) -> int | None:
        """Idle seconds before the last pod goes; None when the role never scales to zero."""
        if self.min_replicas > 0:
            return None
        if self.scale_to_zero_after_seconds is None:
            return DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS
        return self.scale_to_zero_after_seconds


def _kv_cache_target() -> Any:
    return Field(
        0.7,
        gt=0,
        le=1,
        alias="targetKVCacheUsage",
        description="Mean KV cache usage (0-1) the autoscaler keeps the role at. It must be below "
        "engine.cachePrefillWatermark, where engines stop taking new prompts.",
    )


def _queued_tokens_target() -> Any:
    return Field(
        8192,
        ge=1,
        description="Prompt tokens waiting (in Redis and in the engines) per pod that the "
        "autoscaler allows before it adds pods; queued work also brings the role back "
        "from zero.",
    )


class NormalRole(RoleSpec):
    """Normal mode: engines that prefill and decode (`--role normal`)."""

    target_kv_cache_usage: float = _kv_cache_target()
    target_queued_tokens_per_replica: int = _queued_tokens_target()


class DecodeRole(RoleSpec):
    """Disaggregated mode: decode engines (`--role completion`) that fetch KV from prefill."""

    target_kv_cache_usage: float = _kv_cache_target()


class PrefillRole(RoleSpec):
    """Disaggregated mode: prefill engines (`--role prompt`) that hand KV to decode."""

    target_budget_utilization: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Mean share (0-1) of each prefill pod's capacity in use, read as the "
        "share of time it spends prefilling, which the autoscaler keeps the role at.",
    )
    target_queued_tokens_per_replica: int = _queued_tokens_target()
