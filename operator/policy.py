"""From a role's spec to the autoscaler's policy: one mapping, for both actuators."""

from __future__ import annotations

from tandem.operator.role_spec import RoleSpec
from tandem.operator.scaling_policy import ScalingPolicy


def scaling_policy(role: RoleSpec) -> ScalingPolicy:
    """The ScalingPolicy of a NormalRole, PrefillRole or DecodeRole (unused targets keep
    the policy's defaults: decode reads no queued-tokens target, prefill no KV target)."""
    targets = {
        name: getattr(role, name)
        for name in (
            "target_kv_cache_usage",
            "target_budget_utilization",
            "target_queued_tokens_per_replica",
        )
        if hasattr(role, name)
    }
    idle = role.scale_to_zero_after
    return ScalingPolicy(
        min_replicas=role.min_replicas,
        max_replicas=role.max_replicas,
        tolerance=role.tolerance,
        scale_up_max_step=role.scale_up_max_step,
        scale_up_max_percent=float(role.scale_up_max_percent),
        scale_down_stabilization_seconds=float(role.scale_down_stabilization_seconds),
        **({"scale_to_zero_after_seconds": float(idle)} if idle is not None else {}),
        **targets,
    )
