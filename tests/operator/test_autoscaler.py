"""The autoscaler's rules as tables and properties: a pure function, so no cluster, no clock."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.imports import packages_loaded

from tandem.operator.autoscaler import (
    Decision,
    RoleObservation,
    ScalingHistory,
    decide,
    decide_all,
)
from tandem.operator.events import readability_events
from tandem.operator.pod_load import PodLoad
from tandem.operator.role_name import RoleName
from tandem.operator.scaling_policy import ScalingPolicy
from tandem.protocol import Role
from tandem.queue_state import QueueState

NORMAL, PREFILL, DECODE = RoleName.NORMAL, RoleName.PREFILL, RoleName.DECODE
POLICY = ScalingPolicy(min_replicas=1, max_replicas=32)
TOKENS = POLICY.target_queued_tokens_per_replica


def queue(tokens=0, waiting=0, pending=0, handoff_waiting=0, handoff_pending=0) -> QueueState:
    return QueueState({2: 0, 1: waiting, 0: 0}, pending, tokens, handoff_waiting, handoff_pending)


def pods(n, *, kv=0.7, running=10, waiting=0, util=0.7, ready=True, first=0):
    return tuple(
        PodLoad(f"p{first + i}", ready, kv, running, waiting, 0, budget_utilization=util)
        for i in range(n)
    )


def observe(current, *groups) -> RoleObservation:
    return RoleObservation(current, tuple(p for g in groups for p in g))


def once(role, obs, q=None, policy=POLICY, history=None, now=0.0) -> Decision:
    return decide(role, obs, q or queue(), policy, history or ScalingHistory(), now)


class Loop:
    """Evaluations every `interval` seconds; the actuator obeys and pods start at once."""

    def __init__(self, role, replicas, policy=POLICY, interval=15.0) -> None:
        self.role, self.replicas, self.policy, self.interval = role, replicas, policy, interval
        self.history, self.now, self.events = ScalingHistory(), 0.0, []

    def step(self, obs_for, q=None) -> Decision:
        d = decide(
            self.role, obs_for(self.replicas), q or queue(), self.policy, self.history, self.now
        )
        if d.changed:
            self.events.append((self.now, d.current, d.replicas))
        self.replicas, self.history = d.replicas, d.history
        self.now += self.interval
        return d


def kv_load(total: float, *, running_per_unit: float = 10):
    """Decode pods sharing `total` replicas' worth of KV at the 0.7 target."""

    def obs(n: int) -> RoleObservation:
        per = min(1.0, total * 0.7 / n) if n else 0.0
        return observe(n, pods(n, kv=per, running=round(per * running_per_unit / 0.7)))

    return obs


# ------------------------------------------------------------------ steady, step, flapping


def test_a_hold_says_both_views_where_they_differ():
    # A pod starting counts idle going up and at target going down: "asks 0.00, within
    # tolerance" of one replica read as a contradiction, the hold's cause unsaid.
    d = once(DECODE, observe(1))
    assert (d.replicas, d.changed) == (1, False)
    assert "kv_cache asks 0.00 (going down, kv_cache asks 1.00), within tolerance" in d.reason


@pytest.mark.parametrize(
    ("role", "obs", "q"),
    [
        (DECODE, observe(4, pods(4, kv=0.7)), queue()),
        (NORMAL, observe(4, pods(4, kv=0.7)), queue(tokens=3 * TOKENS)),
        (PREFILL, observe(4, pods(4, util=0.7)), queue(tokens=2 * TOKENS)),
        (PREFILL, observe(4, pods(4, util=0.1)), queue(tokens=4 * TOKENS)),
    ],
)
def test_steady_load_changes_nothing(role, obs, q):
    d = once(role, obs, q)
    assert (d.replicas, d.changed) == (4, False)
    assert "within tolerance" in d.reason


@pytest.mark.parametrize(
    ("role", "obs", "q"),
    [
        # Prefill: budget saturated and 4x the queued tokens (16 replicas' worth).
        (PREFILL, observe(4, pods(4, util=1.0)), queue(tokens=16 * TOKENS)),
        # Normal: KV full and the queue 4x what 4 replicas should have ahead of them.
        (NORMAL, observe(4, pods(4, kv=1.0)), queue(tokens=16 * TOKENS, waiting=40)),
        # Decode: KV saturates at 1, the handoffs nobody has room for show the rest.
        (DECODE, observe(4, pods(4, kv=1.0, running=14)), queue(handoff_waiting=104)),
    ],
)
def test_a_4x_load_step_scales_up_in_one_evaluation_bounded_by_the_step(role, obs, q):
    d = once(role, obs, q)
    assert d.recommendation >= 16
    # Default step: max(4 pods, 100 %) of the 4 ready pods.
    assert d.replicas == 8
    assert "step limit 8" in d.reason
    tight = ScalingPolicy(max_replicas=32, scale_up_max_step=1, scale_up_max_percent=50)
    assert once(role, obs, q, policy=tight).replicas == 6


def test_the_decode_backlog_costs_the_kv_of_requests_whose_kv_is_arriving_too():
    # A burst: each decoder holds KV for 5 running requests and 15 whose KV is being
    # fetched (two at a time). Divided by the 5 alone, the 20 handoffs waiting each cost
    # 4x their KV: 4 -> 8 pods where 5 hold them.
    receiving = tuple(
        dataclasses.replace(p, kv_receiving_requests=15) for p in pods(4, kv=0.64, running=5)
    )
    d = once(DECODE, observe(4, receiving), queue(handoff_waiting=20))
    # (4 x 0.64 + 20 x 0.032) / 0.7 = 4.57
    assert d.replicas == 5 and "kv_cache asks 4.57" in d.reason


def slotted(n, *, kv, running, slots=256, parked=0):
    """Pods that export their sequence slots (and a decoder's parked handoffs)."""
    return tuple(
        dataclasses.replace(p, max_running_requests=slots, handoffs_parked=parked)
        for p in pods(n, kv=kv, running=running)
    )


@pytest.mark.parametrize("role", [DECODE, NORMAL])
def test_a_role_whose_sequence_slots_are_full_is_not_idle_at_a_low_kv_usage(role):
    # Short chats on a large pool: every slot taken at a tenth of the KV. To the KV
    # signal alone the 4 pods were 0.57 of one: scaled to 1 under a steady load, then
    # climbing back on the queue that left.
    d = once(role, observe(4, slotted(4, kv=0.1, running=256)))
    assert (d.replicas, d.changed) == (4, False)
    assert "slots asks 4.00" in d.reason
    # Half the slots taken: the pods that hold them full, rounded up.
    assert once(role, observe(4, slotted(4, kv=0.1, running=100))).replicas == 2


@pytest.mark.parametrize(
    ("role", "q"), [(DECODE, queue(handoff_waiting=512)), (NORMAL, queue(waiting=512))]
)
def test_requests_queued_for_full_sequence_slots_scale_the_role_up(role, q):
    d = once(role, observe(4, slotted(4, kv=0.1, running=256)), q)
    assert d.replicas == 6 and "slots asks 6.00" in d.reason  # 4 + 512 / 256


def test_prefill_waits_for_decode_to_catch_up_rather_than_grow():
    # Every prefill pod's KV is full of offers no decoder took, and handoffs wait in
    # Redis: the prompts queue because decode is behind, and prefill grew 2 -> 6 on them
    # (pods that would fill with offers too, for the same decoders).
    full = tuple(dataclasses.replace(p, kv_pinned_requests=5) for p in pods(2, kv=0.95, util=0.2))
    behind = queue(tokens=8 * TOKENS, handoff_waiting=50)
    d = once(PREFILL, observe(2, full), behind)
    assert (d.replicas, d.changed) == (2, False)
    assert "held: decode is behind" in d.reason
    # Decode keeping up (nothing waits for it), or a prefill pod with room: prefill's
    # own queue, and prefill grows.
    assert once(PREFILL, observe(2, full), queue(tokens=8 * TOKENS)).replicas == 6
    roomy = (full[0], dataclasses.replace(full[1], kv_cache_usage=0.5))
    assert once(PREFILL, observe(2, roomy), behind).replicas == 6
    # Full is above the deployment's own watermark, where its engines stop pulling.
    tuned = [dataclasses.replace(POLICY, cache_prefill_watermark=w) for w in (0.8, 0.98)]
    at = tuple(dataclasses.replace(p, kv_cache_usage=0.85) for p in full)
    assert once(PREFILL, observe(2, at), behind, policy=tuned[0]).replicas == 2
    assert once(PREFILL, observe(2, full), behind, policy=tuned[1]).replicas == 6


def test_a_decoders_parked_handoffs_are_in_its_backlog():
    # Each decoder parked a long handoff it has no KV room for: it is in no queue of its
    # scheduler, nor waiting in Redis, and the role read within tolerance (2.14).
    d = once(DECODE, observe(2, slotted(2, kv=0.75, running=10, parked=1)))
    assert d.replicas == 3 and "kv_cache asks 2.36" in d.reason


@pytest.mark.parametrize(
    ("ready", "step", "percent", "expected"),
    [(4, 4, 100.0, 8), (10, 4, 100.0, 20), (10, 4, 10.0, 14), (10, 1, 0.0, 11), (1, 2, 300.0, 4)],
)
def test_the_step_limit_is_the_larger_of_pods_and_percent(ready, step, percent, expected):
    policy = ScalingPolicy(max_replicas=100, scale_up_max_step=step, scale_up_max_percent=percent)
    d = once(PREFILL, observe(ready, pods(ready)), queue(tokens=1000 * TOKENS), policy)
    assert d.replicas == expected


def test_one_pod_past_the_step_limit_is_held_at_the_limit():
    d = once(PREFILL, observe(4, pods(4)), queue(tokens=9 * TOKENS))
    assert d.recommendation == 9
    assert d.replicas == 8 and "step limit 8" in d.reason


def test_min_replicas_holds_a_quiet_role_up():
    policy = ScalingPolicy(min_replicas=3, max_replicas=8)
    d = once(PREFILL, observe(4, pods(4, util=0.0)), queue(), policy)
    assert d.recommendation < 3 and d.replicas == 3 and "minReplicas 3" in d.reason


def test_load_flapping_inside_the_tolerance_never_scales():
    # A seeded random walk of the total within ±8 % of the target, each pod jittered.
    rng, level = random.Random(20240611), 1.0
    loop = Loop(DECODE, 6)
    for _ in range(100):
        level = min(1.08, max(0.92, level + rng.uniform(-0.04, 0.04)))
        usage = [0.7 * level * rng.uniform(0.99, 1.01) for _ in range(6)]
        loop.step(lambda n, u=usage: observe(n, *(pods(1, kv=x, first=i) for i, x in enumerate(u))))
    assert loop.events == []


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.91, 1.09), min_size=100, max_size=100))
def test_any_load_inside_the_tolerance_band_never_scales(levels):
    loop = Loop(PREFILL, 5)
    for level in levels:
        loop.step(lambda n, x=level: observe(n, pods(n, util=0.7 * x)))
    assert loop.events == []


# ------------------------------------------------------------------ scale down


def test_a_drop_scales_down_only_after_the_window():
    loop = Loop(DECODE, 8)
    loop.step(kv_load(8))  # t=0: the last high recommendation
    while loop.now <= 600:
        loop.step(kv_load(2))
    assert loop.events == [(300.0, 8, 2)]


def test_the_window_keeps_the_highest_recommendation_not_the_latest():
    loop = Loop(DECODE, 8)
    loop.step(kv_load(8))  # t=0
    for _ in range(9):
        loop.step(kv_load(2))  # t=15..135
    loop.step(kv_load(5))  # t=150: a brief rebound
    while loop.now <= 600:
        loop.step(kv_load(2))
    # At 300 the 8 leaves the window but the 5 of t=150 holds until 450.
    assert loop.events == [(300.0, 8, 5), (450.0, 5, 2)]


def test_a_zero_window_scales_down_at_once():
    policy = ScalingPolicy(max_replicas=32, scale_down_stabilization_seconds=0)
    d = once(DECODE, kv_load(2)(8), policy=policy)
    assert d.replicas == 2


# ------------------------------------------------------------------ scale-up window

UP_30 = ScalingPolicy(max_replicas=32, scale_up_stabilization_seconds=30)


def run_queue(loop: Loop, replicas_worth) -> None:
    """Prefill evaluations where the queued tokens alone ask for each listed count."""
    for k in replicas_worth:
        loop.step(lambda n: observe(n, pods(n, util=0.0)), queue(tokens=k * TOKENS))


def test_a_single_high_reading_inside_the_up_window_adds_no_pod():
    loop = Loop(PREFILL, 2, policy=UP_30)
    run_queue(loop, [2, 2, 6, 2, 2, 2])  # one spike at t=30
    assert loop.events == []


def test_a_sustained_rise_scales_up_once_the_window_agrees():
    loop = Loop(PREFILL, 2, policy=UP_30)
    run_queue(loop, [2])  # t=0
    d = loop.step(lambda n: observe(n, pods(n, util=0.0)), queue(tokens=6 * TOKENS))  # t=15
    assert d.replicas == 2 and "scale-up held at 2 by the 30s window" in d.reason
    run_queue(loop, [6])  # t=30: the window (0, 30] holds 6 and 6
    assert loop.events == [(30.0, 2, 6)]


def test_the_up_window_takes_its_lowest_recommendation_not_the_latest():
    policy = ScalingPolicy(max_replicas=32, scale_up_stabilization_seconds=45)
    loop = Loop(PREFILL, 2, policy=policy)
    run_queue(loop, [2, 4, 6, 6, 6])  # t=0..60
    # At 45 the window (0, 45] holds 4, 6, 6: up to 4; at 60, (15, 60], all 6.
    assert loop.events == [(45.0, 2, 4), (60.0, 4, 6)]


def test_the_up_window_never_delays_a_start_from_zero():
    idle = once(PREFILL, observe(1, pods(1, util=0.0)), policy=UP_30)  # recommends 1 at t=0
    d = once(PREFILL, observe(0), queue(tokens=3 * TOKENS), UP_30, idle.history, now=15.0)
    assert d.replicas == 3


def test_a_zero_up_window_is_the_default_and_scales_at_once():
    assert ScalingPolicy().scale_up_stabilization_seconds == 0
    loop = Loop(PREFILL, 2)
    run_queue(loop, [2, 6])
    assert loop.events == [(15.0, 2, 6)]


# ------------------------------------------------------------------ pods still starting


def test_pods_still_starting_are_credited_no_second_scale_up():
    busy = queue(tokens=16 * TOKENS)
    first = once(PREFILL, observe(2, pods(2, util=1.0)), busy)
    assert first.replicas == 6  # max(2 + 4, 2 x 200 %)
    # Next evaluation: 4 pods still starting (scraped, not ready), the backlog has
    # even grown; the step is spent on them, so nothing more is asked yet.
    starting = pods(4, util=None, running=0, ready=False, first=2)
    obs = observe(6, pods(2, util=1.0), starting)
    again = once(PREFILL, obs, queue(tokens=20 * TOKENS), history=first.history, now=15.0)
    assert (again.replicas, again.changed) == (6, False)
    # Pods that are not even scraped yet (no PodLoad at all) count the same.
    quiet = once(PREFILL, observe(6, pods(2, util=1.0)), busy, history=first.history, now=15.0)
    assert quiet.replicas == 6
    # Once they are ready the scale-up resumes from 6 ready pods.
    up = once(PREFILL, observe(6, pods(6, util=1.0)), busy, history=again.history, now=30.0)
    assert up.replicas == 12


def test_kv_demand_is_absolute_so_starting_pods_do_not_repeat_a_scale_up():
    # 2 ready decoders at 0.98 ask for 3 replicas; with 1 more starting, the same
    # usage asks for the same 3 (HPA: not-ready pods count 0 when scaling up).
    first = once(DECODE, observe(2, pods(2, kv=0.98)))
    assert first.replicas == 3
    obs = observe(3, pods(2, kv=0.98), pods(1, kv=0.0, running=0, ready=False, first=2))
    assert once(DECODE, obs, history=first.history, now=15.0).replicas == 3


def test_pods_without_metrics_count_at_target_when_scaling_down():
    # 4 replicas, 2 of them unmeasured: their idle-looking absence must not pull
    # the role down (HPA: missing metrics are 100 % of target on scale-down).
    d = once(DECODE, observe(4, pods(2, kv=0.3)))
    assert d.recommendation == 3  # ceil(0.6 / 0.7 + 2 unmeasured)
    # The reason says the figure that decided: it read "asks 0.86, 0.71x current"
    # (the scale-up view's demand beside the scale-down view's ratio).
    assert d.reason == "decode scale 4->3: kv_cache asks 2.86, 0.71x current"
    assert once(DECODE, observe(4, pods(2, kv=0.6))).replicas == 4


# ------------------------------------------------------------------ zero and one


ZERO = ScalingPolicy(min_replicas=0, max_replicas=8, scale_to_zero_after_seconds=60)


@pytest.mark.parametrize(
    ("role", "q", "expected"),
    [
        (PREFILL, queue(tokens=1), 1),
        (NORMAL, queue(waiting=1), 1),
        (PREFILL, queue(pending=1), 1),
        (DECODE, queue(handoff_waiting=1), 1),
        # Decode wakes with prefill's work, not after the first handoff.
        (DECODE, queue(tokens=500), 1),
        # A big backlog starts up to one step of pods at once.
        (PREFILL, queue(tokens=100 * TOKENS), 4),
        (NORMAL, queue(), 0),
    ],
)
def test_queued_work_scales_from_zero(role, q, expected):
    d = once(role, observe(0), q, ZERO)
    assert d.replicas == expected
    assert ("scale from zero" in d.reason) == (expected > 0)
    # Named only where it sized the step: a 9-token prompt's "asks 0.00" read as the cause.
    assert (" asks " in d.reason) == (expected > 1), d.reason


def test_scale_to_zero_after_the_idle_period_not_before():
    idle = lambda n: observe(n, pods(n, kv=0.0, running=0, util=0.0))  # noqa: E731
    loop = Loop(NORMAL, 1, policy=ZERO, interval=10.0)
    loop.step(lambda n: observe(n, pods(n, kv=0.3, running=2)))  # t=0: work
    while loop.now <= 120:
        loop.step(idle)
    assert loop.events == [(60.0, 1, 0)]


def test_work_restarts_the_idle_clock():
    idle = lambda n: observe(n, pods(n, kv=0.0, running=0, util=0.0))  # noqa: E731
    loop = Loop(PREFILL, 1, policy=ZERO, interval=10.0)
    for t in range(13):  # t=0..120
        loop.step(idle, queue(pending=1) if t == 4 else None)
    assert loop.events == [(100.0, 1, 0)]


def test_a_trickle_of_work_between_evaluations_is_not_idle():
    # A 3 s request every 30 s, evaluated every 15 s: every gauge read 0 at each scrape,
    # and the role went to zero 7 s after serving a request, then back, over and over.
    loop = Loop(PREFILL, 1, policy=ZERO, interval=15.0)
    for t in range(20):
        stepped = t % 2 == 0  # the engine ran steps in every other interval
        obs = lambda n, s=stepped: observe(  # noqa: E731
            n, tuple(PodLoad(f"p{i}", True, 0.0, 0, 0, 0, stepped=s) for i in range(n))
        )
        loop.step(obs)
    assert loop.events == [] and loop.replicas == 1


@pytest.mark.parametrize("field", ["handoff_waiting", "handoff_pending"])
def test_handoffs_in_flight_keep_unreadable_prefill_pods(field):
    # Prefill's pods hold the KV those handoffs wait to have fetched: with their metrics
    # unreadable, the role read idle and went to zero, the KV with it.
    loop = Loop(PREFILL, 2, policy=ZERO, interval=15.0)
    for _ in range(8):
        loop.step(lambda n: RoleObservation(n, (), unreadable=n), queue(**{field: 5}))
    assert loop.events == [] and loop.replicas == 2


def test_a_role_at_zero_is_not_reported_unreadable():
    # Scaled to zero with its pods unreadable, it said "no pod's metrics readable" at
    # every evaluation while it had no pod at all.
    history = ScalingHistory(unreadable_since=5.0, last_active_at=0.0)
    d = once(NORMAL, observe(0), policy=ZERO, history=history, now=200.0)
    assert d.replicas == 0 and d.unreadable is None and not d.unreadable_changed
    assert "readable" not in d.reason


def test_pods_never_read_are_not_said_readable_again_at_zero_nor_after():
    # Every pod unreadable (a NetworkPolicy on port 8100) and idle: reaching zero posted
    # "metrics readable again", though no pod had been read.
    loop, said = Loop(NORMAL, 1, policy=ZERO), []

    def step(obs_for, q) -> None:
        said.extend(e.reason for e in readability_events({NORMAL: loop.step(obs_for, q)}))

    unreadable = lambda n: RoleObservation(n, (), unreadable=n)  # noqa: E731
    for _ in range(12):  # past scaleToZeroAfterSeconds, never seen idle: held
        step(unreadable, queue())
    assert loop.replicas == 1 and said == ["MetricsUnreadable"]
    loop.replicas = 0  # taken to zero by an edit of spec.replicas
    step(unreadable, queue())
    assert said == ["MetricsUnreadable"]
    step(unreadable, queue(waiting=3))  # woken, still unreadable: nothing new to say
    step(unreadable, queue(waiting=3))
    assert loop.replicas == 1 and said == ["MetricsUnreadable"]
    step(lambda n: observe(n, pods(n, kv=0.5)), queue(waiting=3))  # read at last
    assert said == ["MetricsUnreadable", "MetricsReadable"]


def test_a_load_exactly_at_the_tolerance_band_edge_keeps_the_count():
    # 13 decoders at 0.63 of the 0.7 target: 0.9 x current, "within 1 +- 0.1" as the docs
    # say, though 0.63 / 0.7 is a hair below 0.9 in floats.
    d = once(DECODE, observe(13, pods(13, kv=0.63, running=9)))
    assert d.replicas == 13 and "within tolerance" in d.reason


def test_pods_kubernetes_reports_ready_are_up_for_the_step_limit_whatever_their_readyz():
    # 8 pods up, their /readyz slow under the load (read not ready), a backlog asking for
    # 40: "keep 8->8, step limit 8 (0 ready)" where the same pods unread gave 8->16.
    hot = tuple(PodLoad(f"p{i}", False, 1.0, 14, 0, 0) for i in range(8))
    flood = queue(tokens=40 * TOKENS)
    assert once(NORMAL, RoleObservation(8, hot, up=8), flood).replicas == 16
    assert once(NORMAL, RoleObservation(8, hot), flood).replicas == 8  # as `tandem up -f`


def test_a_pod_still_loading_after_a_scale_from_zero_is_never_idle():
    # A request woke the role; its client left (the gateway withdrew its entry) while
    # the one pod loaded for minutes: the idle timer took it away before it was ready,
    # and the next request started the load afresh.
    loop = Loop(NORMAL, 0, policy=ZERO)
    loop.step(lambda n: observe(n), queue(tokens=500))
    assert loop.replicas == 1
    loading = lambda n: RoleObservation(n, (), up=0)  # noqa: E731
    for _ in range(20):  # 300 s of loading, nothing queued
        loop.step(loading)
    assert loop.replicas == 1
    last_loading = loop.now - loop.interval
    for _ in range(8):  # ready and idle: the clock runs from the last look at it loading
        loop.step(lambda n: observe(n, pods(n, kv=0.0, running=0)))
    assert loop.events[-1] == (last_loading + 60, 1, 0)


def test_pods_that_cannot_be_read_are_never_taken_for_idle():
    # A NetworkPolicy keeps the operator off port 8100; short requests come and go
    # between scrapes, so Redis reads empty at every one: only a pod's `stepped` would
    # tell, and none can be read. The role holds (rule 2), as with a readable one.
    loop = Loop(NORMAL, 1, policy=ZERO)
    for _ in range(40):  # 600 s
        loop.step(lambda n: RoleObservation(n, (), unreadable=n, up=n))
    assert loop.replicas == 1 and loop.events == []


def test_a_fresh_history_never_counts_as_idle():
    # An operator that just restarted knows nothing of the past: it waits a full period.
    d = once(NORMAL, observe(1, pods(1, kv=0.0, running=0)), policy=ZERO, now=1e6)
    assert d.replicas == 1 and d.history.last_active_at == 1e6


def test_min_replicas_one_never_goes_to_zero():
    loop = Loop(NORMAL, 1, policy=ScalingPolicy(scale_to_zero_after_seconds=0), interval=60)
    for _ in range(10):
        loop.step(lambda n: observe(n, pods(n, kv=0.0, running=0)))
    assert loop.events == [] and loop.replicas == 1


# ------------------------------------------------------------------ roles


def test_prefill_heavy_load_raises_prefill_not_decode():
    observed = {
        PREFILL: observe(2, pods(2, util=1.0)),
        DECODE: observe(2, pods(2, kv=0.7)),
    }
    policies = {PREFILL: POLICY, DECODE: POLICY}
    out = decide_all(observed, queue(tokens=10 * TOKENS), policies, {}, 0.0)
    assert out[PREFILL].replicas == 6 and out[DECODE].replicas == 2


def test_decode_heavy_load_raises_decode_not_prefill():
    observed = {
        PREFILL: observe(2, pods(2, util=0.7)),
        DECODE: observe(2, pods(2, kv=1.0, running=20)),
    }
    policies = {PREFILL: POLICY, DECODE: POLICY}
    out = decide_all(observed, queue(handoff_waiting=40), policies, {}, 0.0)
    assert out[PREFILL].replicas == 2 and out[DECODE].replicas == 6
    assert dict(out[DECODE].signals)["kv_cache"] == pytest.approx(2 * (1 + 1) / 0.7)


def test_a_decode_role_full_at_its_max_holds_prefill_where_it_is():
    # Decode may not grow past 2 and asks for 6: prefill grown on its queue would only
    # prefill prompts whose KV waits in it for a decoder (expiring there, prefilled
    # again by one). A simulated run: prefill 1 -> 5 -> 8 pods for the same throughput.
    observed = {
        PREFILL: observe(2, pods(2, util=1.0)),
        DECODE: observe(2, pods(2, kv=1.0, running=20)),
    }
    capped = {PREFILL: POLICY, DECODE: ScalingPolicy(max_replicas=2)}
    behind = queue(tokens=10 * TOKENS, handoff_waiting=40)
    out = decide_all(observed, behind, capped, {}, 0.0)
    assert (out[PREFILL].replicas, out[DECODE].replicas) == (2, 2)
    assert "held: decode is at maxReplicas 2 and asks for 6" in out[PREFILL].reason
    assert list(out) == [PREFILL, DECODE]  # decided decode first, answered as asked
    # Decode free to grow: both roles grow, each on its own queue.
    out = decide_all(observed, behind, {PREFILL: POLICY, DECODE: POLICY}, {}, 0.0)
    assert (out[PREFILL].replicas, out[DECODE].replicas) == (6, 6)


def test_normal_scales_on_kv_and_on_queued_tokens():
    assert once(NORMAL, observe(2, pods(2, kv=1.0))).replicas == 3
    assert once(NORMAL, observe(2, pods(2, kv=0.7)), queue(tokens=5 * TOKENS)).replicas == 5


def test_engines_buffered_tokens_count_at_their_mean_since_the_last_scrape():
    def buffered(now, mean):
        return PodLoad("p0", True, 0.5, 4, 1, now, mean_waiting_prompt_tokens=mean)

    # Scraped just after a prompt step emptied the buffer: the mean still shows
    # the 3 replicas' worth it held most of the interval.
    assert once(NORMAL, observe(1, (buffered(0, 3 * TOKENS),))).replicas == 3
    # Scraped with a full buffer it rarely holds: the mean asks for 1, not 4.
    assert once(NORMAL, observe(1, (buffered(4 * TOKENS, 0.5 * TOKENS),))).replicas == 1
    # No interval yet (a first scrape): the gauge is all there is.
    assert once(NORMAL, observe(1, (buffered(4 * TOKENS, None),))).replicas == 4


def test_decide_all_needs_a_policy_per_role():
    with pytest.raises(ValueError, match="decode"):
        decide_all({DECODE: observe(1)}, queue(), {PREFILL: POLICY}, {}, 0.0)


def test_engine_roles_map_to_role_names():
    assert [RoleName.of_engine(r) for r in Role] == [NORMAL, PREFILL, DECODE]
    assert [role.engine_role for role in RoleName] == list(Role)


def test_the_autoscaler_imports_no_io_client():
    # Pure: the simulator and tests use it without HTTP, Redis, Prometheus or pydantic.
    io = {"httpx", "redis", "prometheus_client", "kopf", "kubernetes", "pydantic"}
    assert packages_loaded("import tandem.operator.autoscaler", io) == []


# ------------------------------------------------------------------ properties


def pod_loads():
    return st.builds(
        PodLoad,
        pod=st.text("abc", min_size=1, max_size=3),
        ready=st.booleans(),
        kv_cache_usage=st.floats(0.0, 1.0),
        requests_running=st.integers(0, 64),
        requests_waiting=st.integers(0, 16),
        waiting_prompt_tokens=st.integers(0, 50_000),
        budget_utilization=st.none() | st.floats(0.0, 1.0),
        mean_waiting_prompt_tokens=st.none() | st.floats(0.0, 50_000.0),
    )


def queues():
    return st.builds(
        queue,
        tokens=st.integers(0, 10**6),
        waiting=st.integers(0, 100),
        pending=st.integers(0, 100),
        handoff_waiting=st.integers(0, 100),
    )


@st.composite
def policies(draw):
    lo = draw(st.integers(0, 10))
    return ScalingPolicy(
        min_replicas=lo,
        max_replicas=draw(st.integers(max(lo, 1), 40)),
        tolerance=draw(st.floats(0.0, 0.5)),
        scale_up_max_step=draw(st.integers(1, 8)),
        scale_up_max_percent=draw(st.floats(0.0, 300.0)),
        scale_up_stabilization_seconds=draw(st.sampled_from([0.0, 15.0, 60.0])),
        scale_down_stabilization_seconds=draw(st.sampled_from([0.0, 30.0, 300.0])),
        scale_to_zero_after_seconds=draw(st.sampled_from([0.0, 30.0])),
    )


@settings(max_examples=80, deadline=None)
@given(
    role=st.sampled_from(list(RoleName)),
    policy=policies(),
    start=st.integers(0, 50),
    rounds=st.lists(st.tuples(st.lists(pod_loads(), max_size=8), queues()), max_size=6),
)
def test_bounds_hold_and_scale_ups_respect_the_step(role, policy, start, rounds):
    replicas, history = start, ScalingHistory()
    for i, (loads, q) in enumerate(rounds):
        obs = RoleObservation(replicas, tuple(loads))
        d = decide(role, obs, q, policy, history, now=10.0 * i)
        assert policy.min_replicas <= d.replicas <= policy.max_replicas
        if q.queued_tokens or q.total_waiting or q.pending:
            assert d.replicas >= 1  # never to zero, or left there, with work queued
        ready = min(replicas, len(obs.ready_pods))
        step = max(
            ready + policy.scale_up_max_step,
            math.ceil(ready * (1 + policy.scale_up_max_percent / 100) - 1e-9),
        )
        assert d.replicas <= max(replicas, step, policy.min_replicas)
        # Pure: the same inputs give the same decision.
        assert decide(role, obs, q, policy, history, now=10.0 * i) == d
        replicas, history = d.replicas, d.history


def test_history_stays_small_over_a_long_run():
    rng = random.Random(7)
    loop = Loop(DECODE, 4, interval=1.0)
    for _ in range(2000):
        loop.step(kv_load(rng.uniform(1, 8)))
        assert len(loop.history.recommendations) <= 301
        assert len(loop.history.lows) <= 1  # no up window: only the latest


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_replicas": 5, "max_replicas": 2}, "must not exceed"),
        ({"min_replicas": -1}, "min_replicas"),
        ({"max_replicas": 0}, "max_replicas"),
        ({"max_replicas": True}, "max_replicas"),
        ({"target_kv_cache_usage": 0.0}, r"\(0, 1\]"),
        ({"target_kv_cache_usage": 1.5}, r"\(0, 1\]"),
        ({"target_budget_utilization": float("nan")}, "finite"),
        ({"target_queued_tokens_per_replica": 0}, "target_queued_tokens_per_replica"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"scale_up_max_step": 0}, "scale_up_max_step"),
        ({"scale_up_max_percent": -1}, "scale_up_max_percent"),
        ({"scale_up_stabilization_seconds": -1}, "scale_up_stabilization_seconds"),
        ({"scale_down_stabilization_seconds": -5}, "scale_down_stabilization_seconds"),
        ({"scale_to_zero_after_seconds": "60"}, "scale_to_zero_after_seconds"),
    ],
)
def test_bad_policy_values_are_value_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        ScalingPolicy(**fields)


def test_bad_inputs_are_value_errors():
    with pytest.raises(ValueError, match="current_replicas"):
        RoleObservation(-1)
    with pytest.raises(ValueError, match="now"):
        once(DECODE, observe(1), now=float("nan"))
    with pytest.raises(ValueError):
        once("gpu", observe(1))
