"""The autoscaler: how many pods one role wants now (docs/autoscaling.md has the why).

`decide` is a pure function of (role, observed pods, Redis queue state, policy,
history, now): no I/O, no clock, no global state. The caller keeps the returned
`ScalingHistory` and passes it to the next evaluation, so the same inputs always
give the same decision and every rule is a table-driven test.

Each signal is turned into "replicas needed" (role_demand.py: HPA's ratio rule in
absolute form, a pod at the target is one replica). The largest signal wins; then,
in order: tolerance band, scale to / from zero (role_demand.recommend), scale-up and
scale-down stabilisation windows, scale-up step limit, min/max bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tandem.operator.pod_load import PodLoad
from tandem.operator.role_demand import EPSILON, recommend, role_demand
from tandem.operator.role_name import RoleName
from tandem.operator.scaling_policy import ScalingPolicy
from tandem.queue_state import QueueState

# Decision.unreadable.
UNREADABLE = "no pod's metrics readable"


@dataclass(frozen=True, slots=True)
class RoleObservation:
    """One role as seen now."""

    # The replicas last asked of the actuator (spec.replicas): starting pods included.
    current_replicas: int
    # A PodLoad for every pod that could be scraped (ready or not). Replicas with
    # no usable load (starting, unreachable) are `current_replicas` minus the ready
    # pods that have the metric: see `_per_pod`.
    pods: tuple[PodLoad, ...] = ()
    # Pods Kubernetes reports ready (the only ones scraped) whose scrape failed
    # (down, too slow, not an engine, a value out of range). They count as pods
    # without metrics for demand; they tell "none could be read" from "none was
    # there to read", and they are up: the step limit counts them as ready.
    unreadable: int = 0
    # Pods Kubernetes reports ready, where the caller knows (the operator): all up, for
    # the step limit, whatever an engine's own /readyz says (slow under the very load
    # that asks for more pods, it froze the scale-up). None: the pods read ready and the
    # unreadable ones (`tandem up -f`, which scrapes engines still loading too).
    up: int | None = None

    def __post_init__(self) -> None:
        n = self.current_replicas
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"current_replicas must be an integer >= 0, got {n!r}")
        if self.unreadable < 0:
            raise ValueError(f"unreadable must be >= 0, got {self.unreadable!r}")
        object.__setattr__(self, "pods", tuple(self.pods))

    @property
    def ready_pods(self) -> tuple[PodLoad, ...]:
        return tuple(p for p in self.pods if p.ready)


@dataclass(frozen=True, slots=True)
class ScalingHistory:
    """What one evaluation leaves for the next; kept by the caller, never mutated."""

    # (time, recommendation) within the scale-down window, each strictly higher
    # than every later one: a later, higher recommendation outlives an earlier one
    # in the window, so the window's maximum is the first entry still inside it
    # and the tuple stays a handful of entries long.
    recommendations: tuple[tuple[float, int], ...] = ()
    # The same for the scale-up window's minimum: each entry strictly lower than
    # every later one.
    lows: tuple[tuple[float, int], ...] = ()
    # When the replica count last changed (status: lastScaleTime).
    last_scale_at: float | None = None
    # When the role last had any work (queued, pending or running).
    last_active_at: float | None = None
    # Since when no pod of the role could be read; None while one can.
    unreadable_since: float | None = None

    @classmethod
    def starting(cls, now: float, replicas: int) -> ScalingHistory:
        """The history of a role whose past is unknown (a new model, an operator
        restart): its current replicas count as recommended now in both windows,
        so a reading at the first evaluation, a spike or a dip, moves nothing
        before a whole window of evidence, as in a running operator."""
        entry = ((now, replicas),)
        return cls(recommendations=entry, lows=entry)

    def peak_since(self, start: float) -> int | None:
        """The highest recommendation made after `start`, if any."""
        return _first_after(self.recommendations, start)

    def low_since(self, start: float) -> int | None:
        """The lowest recommendation made after `start`, if any."""
        return _first_after(self.lows, start)


def _first_after(entries: tuple[tuple[float, int], ...], start: float) -> int | None:
    return next((replicas for t, replicas in entries if t > start), None)


def _recorded(
    entries: tuple[tuple[float, int], ...],
    now: float,
    replicas: int,
    window_start: float,
    outlives: Callable[[int, int], bool],
) -> tuple[tuple[float, int], ...]:
    """`entries` inside the window, less those the new recommendation outlives
    (`outlives(new, old)`), then the new one: a monotonic queue of the window."""
    kept = [(t, r) for t, r in entries if t > window_start]
    while kept and outlives(replicas, kept[-1][1]):
        kept.pop()
    return (*kept, (now, replicas))


@dataclass(frozen=True, slots=True)
class Decision:
    role: RoleName
    replicas: int
    current: int
    # From the signals alone, before the window, the step limit and the bounds.
    recommendation: int
    reason: str
    history: ScalingHistory
    # Replicas each signal asks for (pods without metrics counted idle).
    signals: tuple[tuple[str, float], ...] = ()
    # UNREADABLE ("no pod's metrics readable") while none of the role's pods
    # could be read, the last time some were scraped: the role then holds, moved
    # only by what Redis shows (rule 2). None while one can be read.
    unreadable: str | None = None
    # Whether this evaluation set or cleared `unreadable`: log, or post an Event, once.
    unreadable_changed: bool = False

    @property
    def changed(self) -> bool:
        return self.replicas != self.current


def decide(
    role: RoleName | str,
    observed: RoleObservation,
    queue: QueueState,
    policy: ScalingPolicy,
    history: ScalingHistory,
    now: float,
    hold_up: str | None = None,
) -> Decision:
    """The replicas `role` should have now, why, and the history for next time.
    hold_up: why the role must not grow now (another role's state; _decode_full)."""
    role = RoleName(role)
    if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds, got {now!r}")
    current = observed.current_replicas
    demand = role_demand(
        role, observed.current_replicas, observed.pods, observed.ready_pods, queue, policy
    )
    # A fresh history (operator restart) starts the idle clock now: an unknown
    # past never counts as idle time. Nor does a time when no pod of the role read
    # ready: a pod still loading after a scale from zero has served nothing yet, and
    # pods whose metrics cannot be read may run a request between every two scrapes
    # (what `stepped` tells); either way the role was never seen idle (rule 2).
    last_active = history.last_active_at
    if demand.active or last_active is None or not observed.ready_pods:
        last_active = now
    idle_zero = (
        policy.min_replicas == 0
        and not demand.active
        and now - last_active >= policy.scale_to_zero_after_seconds
    )
    recommendation, why = recommend(current, demand, policy, idle_zero, now - last_active)
    notes = [why]
    unreadable_since = _unreadable_since(observed, history.unreadable_since, now)
    # At zero there is no pod to read: nothing to report, and nothing cleared either (a
    # role whose pods were never read said "readable again" as it reached zero).
    at_zero = observed.current_replicas == 0 and not observed.pods
    reported = None if at_zero else unreadable_since
    if reported is not None:
        # Demand then holds at the current count (rule 2) unless Redis moves it:
        # say why instead of "within tolerance".
        notes = [f"holding: {UNREADABLE}"] if recommendation == current else [why, UNREADABLE]

    replicas = recommendation
    if hold_up is not None and replicas > current > 0:
        notes.append(hold_up)
        replicas = current
    down_window_start = now - policy.scale_down_stabilization_seconds
    up_window_start = now - policy.scale_up_stabilization_seconds
    if replicas > current > 0:
        # HPA: scale up only to the lowest recommendation of the window, this one
        # included (a role at zero starts at once: its work has no pod at all).
        low = history.low_since(up_window_start)
        low = replicas if low is None else min(replicas, low)
        if low < replicas:
            notes.append(
                f"scale-up held at {max(current, low)} by the "
                f"{policy.scale_up_stabilization_seconds:g}s window"
            )
        replicas = max(current, low)
    if replicas < current and not idle_zero:
        # HPA: scale down only to the highest recommendation of the window.
        peak = max(replicas, history.peak_since(down_window_start) or 0)
        if peak > replicas:
            notes.append(
                f"scale-down held at {min(current, peak)} by the "
                f"{policy.scale_down_stabilization_seconds:g}s window"
            )
        replicas = min(current, peak)
    if replicas > current:
        # Measured from ready pods (Knative): pods still starting use up the step,
        # so a scale-up is never stacked on one that has not come up yet. A ready
        # pod whose scrape failed is up all the same: counted as starting, a role
        # whose scrapes time out under load (or a NetworkPolicy) froze at its size
        # with Redis's queue asking for more.
        up = observed.up
        if up is None:
            up = len(observed.ready_pods) + observed.unreadable
        ready = min(current, up)
        limit = max(
            ready + policy.scale_up_max_step,
            math.ceil(ready * (1 + policy.scale_up_max_percent / 100) - EPSILON),
        )
        if replicas > max(current, limit):
            notes.append(f"step limit {max(current, limit)} ({ready} ready)")
            replicas = max(current, limit)
    if replicas < policy.min_replicas:
        notes.append(f"minReplicas {policy.min_replicas}")
    elif replicas > policy.max_replicas:
        notes.append(f"maxReplicas {policy.max_replicas}")
    replicas = min(policy.max_replicas, max(policy.min_replicas, replicas))

    new_history = ScalingHistory(
        recommendations=_recorded(
            history.recommendations,
            now,
            recommendation,
            down_window_start,
            lambda new, old: new >= old,
        ),
        lows=_recorded(
            history.lows, now, recommendation, up_window_start, lambda new, old: new <= old
        ),
        last_scale_at=now if replicas != current else history.last_scale_at,
        last_active_at=last_active,
        unreadable_since=unreadable_since,
    )
    verb = "scale" if replicas != current else "keep"
    return Decision(
        role=role,
        replicas=replicas,
        current=current,
        recommendation=recommendation,
        reason=f"{role} {verb} {current}->{replicas}: " + "; ".join(notes),
        history=new_history,
        signals=tuple((s.name, round(s.up, 6)) for s in demand.signals),
        unreadable=None if reported is None else UNREADABLE,
        unreadable_changed=not at_zero
        and (unreadable_since is None) != (history.unreadable_since is None),
    )


def decide_all(
    observed: Mapping[RoleName, RoleObservation],
    queue: QueueState,
    policies: Mapping[RoleName, ScalingPolicy],
    histories: Mapping[RoleName, ScalingHistory],
    now: float,
) -> dict[RoleName, Decision]:
    """`decide` for every observed role, each on its own signals and history (decode's
    first: a full decode role holds prefill, _decode_full)."""
    missing = [str(role) for role in observed if role not in policies]
    if missing:
        raise ValueError(f"no scaling policy for role(s) {', '.join(missing)}")
    decisions: dict[RoleName, Decision] = {}
    hold = None
    for role in sorted(observed, key=lambda role: role is not RoleName.DECODE):
        history = histories.get(role, ScalingHistory())
        held = hold if role is RoleName.PREFILL else None
        decisions[role] = decide(role, observed[role], queue, policies[role], history, now, held)
        if role is RoleName.DECODE:
            hold = _decode_full(decisions[role], policies[role], queue)
    return {role: decisions[role] for role in observed}


def _decode_full(decode: Decision, policy: ScalingPolicy, queue: QueueState) -> str | None:
    """Why prefill must not grow now, or None: decode is at its maxReplicas, handoffs
    wait for it, and its signals ask for more decoders than it may have. Prefill pods
    added then only prefill prompts whose KV waits in them for a decoder (and expires
    there, to be prefilled again by one): GPUs for nothing."""
    if (
        queue.handoff_waiting > 0
        and decode.current >= policy.max_replicas
        and decode.recommendation > policy.max_replicas
    ):
        return (
            f"held: decode is at maxReplicas {policy.max_replicas} and asks for "
            f"{decode.recommendation}"
        )
    return None


def _unreadable_since(observed: RoleObservation, since: float | None, now: float) -> float | None:
    """Since when no pod of the role could be read; None while one can. Kept as it was
    while the role has no pod at all: nothing was read, so nothing changed."""
    if observed.pods:
        return None
    if observed.current_replicas == 0:
        return since
    if observed.unreadable:
        return now if since is None else since
    return since  # no pod ready, none scraped: nothing new either way
