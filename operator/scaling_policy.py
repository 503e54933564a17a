"""The scaling policy of one role: bounds, targets and damping (docs/autoscaling.md).

Independent of the ModelDeployment CRD on purpose: the CRD's spec is mapped onto
this dataclass field for field (camelCase there, snake_case here), so the
autoscaler can be tested, and used by `tandem up`, without any Kubernetes type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    """How one role scales. Each field maps to the CRD field named in its comment.

    Targets a role does not use are ignored (decode reads no queued-tokens target,
    prefill no KV target), so one dataclass serves all three roles.
    """

    # minReplicas: 0 allows scale to zero after `scale_to_zero_after_seconds` idle.
    min_replicas: int = 1
    # maxReplicas: equal to min_replicas (both 1 by default) means a fixed count.
    max_replicas: int = 1
    # targetKVCacheUsage (decode, normal): the KV fraction each pod should run at.
    target_kv_cache_usage: float = 0.7
    # targetBudgetUtilization (prefill): the share of each pod's prefill token
    # capacity to use (pod_load.budget_utilization).
    target_budget_utilization: float = 0.7
    # targetQueuedTokensPerReplica (prefill, normal): prompt tokens waiting, in Redis
    # and inside the engines, that one replica may have ahead of it. Half the
    # waiting buffer of an engine of 8k context (max_waiting_tokens, two steps'
    # budget): scale before the buffers are full and the backlog is only visible
    # in Redis.
    target_queued_tokens_per_replica: int = 8192
    # tolerance: no change while |demand / current - 1| <= tolerance (HPA's 0.1).
    tolerance: float = 0.1
    # scaleUpMaxStep / scaleUpMaxPercent: one evaluation adds at most the larger of
    # `step` pods and `percent` % of the ready pods (HPA's default: 4 pods or 100 %).
    scale_up_max_step: int = 4
    scale_up_max_percent: float = 100.0
    # scaleUpStabilizationSeconds: scale up only to the lowest recommendation of
    # this window (HPA's default, 0 s: at once). docs/simulator.md measures 30-60 s
    # against a bursty day: far fewer scale events and GPU-hours, a few SLO misses.
    scale_up_stabilization_seconds: float = 0.0
    # scaleDownStabilizationSeconds: scale down only to the highest recommendation
    # of this window (HPA's default, 300 s).
    scale_down_stabilization_seconds: float = 300.0
    # scaleToZeroAfterSeconds: with min_replicas 0, how long a role must have had
    # no work at all before its last pod goes.
    scale_to_zero_after_seconds: float = 300.0
    # engine.cachePrefillWatermark (the spec's, for every role): KV usage above which
    # an engine pulls no work. Prefill reads it to tell prompts that wait on decode.
    cache_prefill_watermark: float = EngineConfig.cache_prefill_watermark

    def __post_init__(self) -> None:
        _count("min_replicas", self.min_replicas, minimum=0)
        _count("max_replicas", self.max_replicas, minimum=1)
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must not exceed "
                f"max_replicas ({self.max_replicas})"
            )
        _fraction("target_kv_cache_usage", self.target_kv_cache_usage)
        _fraction("target_budget_utilization", self.target_budget_utilization)
        _fraction("cache_prefill_watermark", self.cache_prefill_watermark)
        _count("target_queued_tokens_per_replica", self.target_queued_tokens_per_replica, 1)
        _number("tolerance", self.tolerance)
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance!r}")
        # At least one pod per step: otherwise a role at zero could never start.
        _count("scale_up_max_step", self.scale_up_max_step, minimum=1)
        _non_negative("scale_up_max_percent", self.scale_up_max_percent)
        _non_negative("scale_up_stabilization_seconds", self.scale_up_stabilization_seconds)
        _non_negative("scale_down_stabilization_seconds", self.scale_down_stabilization_seconds)
        _non_negative("scale_to_zero_after_seconds", self.scale_to_zero_after_seconds)


def _number(name: str, value: object) -> float:
    # bool is an int: True would pass as 1 and hide a misplaced flag.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _count(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _fraction(name: str, value: object) -> None:
    if not 0.0 < _number(name, value) <= 1.0:
        raise ValueError(f"{name} is a fraction of capacity: it must be in (0, 1], got {value!r}")


def _non_negative(name: str, value: object) -> None:
    if _number(name, value) < 0.0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
