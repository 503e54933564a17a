"""What a role's signals ask for, in replicas, and the count they recommend.

Each signal is turned into "replicas needed" (demand), HPA's ratio rule in
absolute form: demand = sum over ready pods of metric / target, so a pod at the
target is one replica. The largest signal wins; `recommend` applies the tolerance
band and scale to / from zero (docs/autoscaling.md, rules 1-4). Pure, like the
autoscaler that calls it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.operator.pod_load import PodLoad
from tandem.operator.role_name import RoleName
from tandem.operator.scaling_policy import ScalingPolicy
from tandem.queue_state import QueueState

# ceil() of a demand computed in floats: 0.7 * 3 / 0.7 must ask for 3 pods, not 4.
EPSILON = 1e-9


@dataclass(frozen=True, slots=True)
class Signal:
    name: str
    # Replicas needed, pods lacking the metric counted idle (HPA's scale-up rule)...
    up: float
    # ...and counted at the target (HPA's scale-down rule for missing metrics).
    down: float


@dataclass(frozen=True, slots=True)
class Demand:
    signals: tuple[Signal, ...]
    active: bool

    @property
    def up(self) -> float:
        return max((s.up for s in self.signals), default=0.0)

    @property
    def down(self) -> float:
        return max((s.down for s in self.signals), default=0.0)

    @property
    def driver(self) -> str:
        return max(self.signals, key=lambda s: s.up).name if self.signals else "none"


def recommend(
    current: int, demand: Demand, policy: ScalingPolicy, idle_zero: bool, idle_for: float
) -> tuple[int, str]:
    """The replicas the signals ask for, with HPA's tolerance band, and why."""
    if idle_zero:
        return 0, f"idle {idle_for:.1f}s >= scaleToZeroAfterSeconds, scale to zero"
    if current == 0:
        if not demand.active:
            return 0, "no work"
        # No pod to measure: the queue alone sizes the first step (at least one pod). A
        # signal that asks less than one pod is not why (its "asks 0.00" read as such).
        first = _ceil(demand.up)
        asked = f" ({_asks(demand)})" if first > 1 else ""
        return max(1, first), f"work queued, scale from zero{asked}"
    up, down = demand.up / current, demand.down / current
    # With EPSILON: exactly at the band's edge (0.63 / 0.7 = 0.9 in floats) is within.
    if up > 1 + policy.tolerance + EPSILON:
        recommendation, why = _ceil(demand.up), f"{_asks(demand)}, {up:.2f}x current"
    elif down < 1 - policy.tolerance - EPSILON:
        recommendation, why = _ceil(demand.down), f"{_asks(demand, down=True)}, {down:.2f}x current"
    else:
        # Both views when they differ: with pods starting (counted at target going down)
        # "asks 0.00, within tolerance" of one replica read as a contradiction.
        views, going_down = _asks(demand), _asks(demand, down=True)
        if going_down != views:
            views += f" (going down, {going_down})"
        return current, f"{views}, within tolerance {policy.tolerance:g}"
    if recommendation == 0:
        # Zero only through the idle timer: queued work with 0 tokens still needs a pod.
        return 1, why + ("; at least 1 until idle" if policy.min_replicas == 0 else "")
    return recommendation, why


def _asks(demand: Demand, *, down: bool = False) -> str:
    """The signal that asks most, in the view that decides (rule 2): going down, the
    pods without metrics count at target, and the reason must say that figure."""
    if not demand.signals:
        return "no signal"
    if down:
        signal = max(demand.signals, key=lambda s: s.down)
        return f"{signal.name} asks {signal.down:.2f}"
    return f"{demand.driver} asks {demand.up:.2f}"


def role_demand(
    role: RoleName,
    current: int,
    pods: tuple[PodLoad, ...],
    ready: tuple[PodLoad, ...],
    queue: QueueState,
    policy: ScalingPolicy,
) -> Demand:
    """Each of the role's signals as replicas needed: `current` replicas, of which
    `pods` were scraped and `ready` read."""
    signals: list[Signal] = []
    if role in (RoleName.NORMAL, RoleName.DECODE):
        # Loads are in range (engine_metrics.parse_metrics refuses the rest).
        usage = sum(p.kv_cache_usage for p in ready)
        if role is RoleName.DECODE:
            # KV usage saturates at 1 per pod, so alone it cannot show a 4x load.
            # Handoffs no decoder has room for are the rest of the demand, each
            # costing the KV a request holds on average: those whose KV is still
            # arriving hold theirs too (left out, a burst's fetches, two at a time,
            # made the average several times too large). A decoder's parked handoff
            # is in no queue of its scheduler, and its entry is not waiting in Redis.
            backlog = queue.handoff_waiting + sum(
                p.requests_waiting + p.handoffs_parked for p in pods
            )
            holding = sum(p.requests_running + p.kv_receiving_requests for p in ready)
            if backlog and holding:
                usage += backlog * usage / holding
        else:  # each request queued for the role needs a sequence slot too
            backlog = queue.total_waiting + sum(p.requests_waiting for p in pods)
        signals.append(
            _per_pod("kv_cache", usage / policy.target_kv_cache_usage, len(ready), current)
        )
        if (slots := _slots(backlog, ready, current)) is not None:
            signals.append(slots)
    if role is RoleName.PREFILL:
        used = [p.budget_utilization for p in ready if p.budget_utilization is not None]
        units = sum(used) / policy.target_budget_utilization
        signals.append(_per_pod("budget", units, len(used), current))
    if role in (RoleName.NORMAL, RoleName.PREFILL):
        # Absolute, like an HPA External metric with an AverageValue target: the
        # tokens are waiting whoever will take them, so no per-pod adjustment.
        # The engines' share is each one's mean since the last scrape.
        tokens = queue.queued_tokens + sum(p.buffered_tokens for p in pods)
        units = tokens / policy.target_queued_tokens_per_replica
        prefill = role is RoleName.PREFILL
        if prefill and units > current and _waiting_on_decode(ready, queue, policy):
            # The prefill pods stopped pulling because decoders do not take their
            # offers: pods added would fill with offers too, their first tokens sent
            # and the rest waiting on the same decoders (docs/autoscaling.md).
            signals.append(Signal("queued_tokens (held: decode is behind)", current, units))
        else:
            signals.append(Signal("queued_tokens", units, units))
    return Demand(tuple(signals), _active(pods, queue))


def _waiting_on_decode(
    ready: tuple[PodLoad, ...], queue: QueueState, policy: ScalingPolicy
) -> bool:
    """Whether the prompts wait on decode, not on prefill: handoffs wait in Redis for a
    decoder while every ready prefill pod's KV is full of offers no decoder took yet (a
    prompt engine above its watermark pulls nothing)."""
    return (
        bool(ready)
        and queue.handoff_waiting > 0
        and all(
            p.kv_pinned_requests and p.kv_cache_usage > policy.cache_prefill_watermark
            for p in ready
        )
    )


def _slots(backlog: int, ready: tuple[PodLoad, ...], current: int) -> Signal | None:
    """The pods the role's requests need at full sequence slots: running, receiving
    and queued. Short requests on a large pool fill every slot at a few per cent of
    its KV: to the KV signal alone such a role was idle, scaled down under a steady
    load and climbed back on the queue that left, a cycle a scale-down window long.
    None where no ready pod exports its slots (engines from before the gauge)."""
    slotted = [p for p in ready if p.max_running_requests is not None]
    if not slotted:
        return None
    used = sum(
        (p.requests_running + p.kv_receiving_requests) / p.max_running_requests for p in slotted
    )
    per_pod = sum(p.max_running_requests for p in slotted) / len(slotted)
    return _per_pod("slots", used + backlog / per_pod, len(slotted), current)


def _per_pod(name: str, units: float, measured: int, current: int) -> Signal:
    """A per-pod signal; replicas lacking the metric are idle going up, at target going down."""
    return Signal(name, units, units + max(0, current - measured))


def _active(pods: Iterable[PodLoad], queue: QueueState) -> bool:
    """Whether the role has any work: what scale from zero and to zero look at."""
    # Taken-but-unacked entries (pending) count: an engine is serving them even
    # when its /metrics could not be read.
    work = queue.queued_tokens > 0 or queue.total_waiting > 0 or queue.pending > 0
    # Handoffs waiting or being fetched: decode must take them, and prefill's pods hold
    # their KV (read from Redis, so unreadable prefill pods are not taken for idle). A
    # normal role has none. Every queued request will need a decoder too: decode's cold
    # start runs alongside prefill's instead of after the first handoff.
    work = work or queue.handoff_waiting > 0 or queue.handoff_pending > 0
    # A pod that stepped since the last scrape had work, though its gauges read 0 now:
    # a trickle of short requests between scrapes was idle to them, scaled to zero.
    return work or any(
        p.requests_running
        or p.requests_waiting
        or p.waiting_prompt_tokens
        or p.kv_pinned_requests
        or p.kv_receiving_requests
        or p.stepped
        for p in pods
    )


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - EPSILON))
