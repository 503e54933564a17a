"""scaling.evaluate, the operator's side of the autoscaler: a role met for the first
time (an operator restart) and a role none of whose pods can be read. The rules
themselves are test_autoscaler.py's."""

from __future__ import annotations

import logging

from tandem.operator.autoscaler import Decision
from tandem.operator.manifests import labels
from tandem.operator.pod_load import PodSample
from tandem.operator.role_name import RoleName
from tandem.operator.scaling import ScalerMemory, evaluate
from tandem.operator.validation import validate_spec
from tandem.protocol import PRIORITIES
from tandem.queue_state import QueueState

NORMAL = RoleName.NORMAL
UNREADABLE = "no pod's metrics readable"


def queue(tokens: int = 0) -> QueueState:
    return QueueState(dict.fromkeys(PRIORITIES, 0), 0, tokens, 0, 0)


def pods(n: int, *, ready: bool = True, role: RoleName = NORMAL, subnet: int = 0) -> list[dict]:
    return [
        {
            "metadata": {
                "name": f"m-{role.value}-{i}",
                "namespace": "ns",
                "labels": labels("m", role),
            },
            "status": {
                "podIP": f"10.0.{subnet}.{i}",
                "conditions": [{"type": "Ready", "status": str(ready)}],
            },
        }
        for i in range(n)
    ]


def samples(n: int, kv: float) -> dict[str, PodSample]:
    return {
        f"m-normal-{i}": PodSample(f"m-normal-{i}", True, 0.0, kv, 4, 0, 0, 8192) for i in range(n)
    }


class Operator:
    """One model's evaluations as the controller makes them, memory kept between them."""

    def __init__(self, replicas: int, **role) -> None:
        body = {"model": {"path": "x"}, "mode": "Normal", "normal": {"maxReplicas": 8, **role}}
        self.spec, self.replicas, self.memory = (
            validate_spec(body, name="m"),
            replicas,
            ScalerMemory(),
        )

    def evaluate(self, pods, samples, now: float, q: QueueState | None = None) -> Decision:
        replicas = {NORMAL: self.replicas}
        out = evaluate(self.spec, replicas, pods, samples, q or queue(), self.memory, now)
        decision, self.memory = out.decisions[NORMAL], out.memory
        self.replicas = decision.replicas
        return decision


# ------------------------------------------------------------------ a fresh operator


def test_a_restarted_operator_holds_a_spike_for_the_scale_up_window():
    # A running operator holds a spike shorter than scaleUpStabilizationSeconds;
    # one restarted during it must too, not scale on its first reading.
    op = Operator(2, scaleUpStabilizationSeconds=60)
    hot = samples(2, kv=1.0)  # asks for 2.86 replicas: 3
    first = op.evaluate(pods(2), hot, now=1000.0)
    assert (first.replicas, first.changed) == (2, False)
    assert "scale-up held at 2 by the 60s window" in first.reason
    assert op.evaluate(pods(2), hot, now=1045.0).replicas == 2
    assert op.evaluate(pods(2), hot, now=1060.0).replicas == 3  # a whole window of it


def test_without_a_scale_up_window_a_fresh_operator_scales_up_at_once():
    assert Operator(2).evaluate(pods(2), samples(2, kv=1.0), now=1000.0).replicas == 3


# ------------------------------------------------------------------ unreadable metrics


def test_a_role_whose_pods_cannot_be_read_holds_and_says_so_once(caplog):
    caplog.set_level(logging.INFO, logger="tandem.operator.scaling")
    # No scale-down window: only rule 2 (unread pods count at target) holds the role.
    op = Operator(3, scaleDownStabilizationSeconds=0)
    for now in (0.0, 15.0, 30.0):
        d = op.evaluate(pods(3), {}, now)  # every scrape failed
        assert (d.replicas, d.unreadable) == (3, UNREADABLE)
        assert d.reason == f"normal keep 3->3: holding: {UNREADABLE}"
        assert d.unreadable_changed == (now == 0.0)
    # Pods gone unready are not scraped: that says nothing new either way.
    d = op.evaluate(pods(3, ready=False), {}, 45.0)
    assert (d.unreadable, d.unreadable_changed) == (UNREADABLE, False)
    d = op.evaluate(pods(3), samples(3, kv=0.7), 60.0)
    assert (d.unreadable, d.unreadable_changed) == (None, True)

    logged = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in logged] == ["WARNING", "INFO"]
    assert logged[0][1].startswith(f"ns/m normal: {UNREADABLE} (3 scraped)")
    assert logged[1][1] == "ns/m normal: metrics readable again after 60s"


def test_a_role_unread_until_it_scaled_to_zero_is_evaluated_without_its_pods():
    # Its pods gone (a NetworkPolicy kept the operator from reading them), the next
    # evaluation raised IndexError on every pass: nothing reconciled for a minute.
    op = Operator(1, minReplicas=0, scaleToZeroAfterSeconds=60)
    assert op.evaluate(pods(1), {}, now=0.0).unreadable == UNREADABLE
    for now in range(15, 150, 15):  # nothing in Redis, but never seen idle: held
        assert op.evaluate(pods(1), {}, float(now)).replicas == 1
    op.replicas = 0  # taken to zero by an edit of spec.replicas
    d = op.evaluate([], {}, 150.0)
    assert (d.replicas, d.unreadable) == (0, None)


def test_a_role_that_cannot_be_read_still_follows_its_queue():
    # Redis is read apart from the engines: 5 replicas' worth of queued tokens still
    # adds pods (unread pods count 0 going up).
    d = Operator(2).evaluate(pods(2), {}, 0.0, queue(tokens=5 * 8192))
    assert d.replicas == 5
    assert d.unreadable == UNREADABLE and UNREADABLE in d.reason


def test_pods_ready_but_unread_count_as_ready_for_the_scale_up_step():
    # Counted as starting, they shrank the step to 0 ready + 4: a role of 6 whose
    # scrapes all time out (busy engines, a NetworkPolicy) held at 6 for good with 20
    # replicas' worth queued in Redis.
    op = Operator(6, maxReplicas=16)
    d = op.evaluate(pods(6), {}, 0.0, queue(tokens=20 * 8192))
    assert d.replicas == 12  # 6 ready, doubled at most (scaleUpMaxPercent 100)
    # Two of eight read (both full), six too slow: the step is from all eight.
    op = Operator(8, maxReplicas=32)
    d = op.evaluate(pods(8), samples(2, kv=1.0), 0.0, queue(tokens=40 * 8192))
    assert d.replicas == 16
    assert d.unreadable is None  # some pods read: not the role-wide hold


# ------------------------------------------------------------------ roles together


def test_the_operator_holds_prefill_while_decode_is_full_at_its_max():
    # The operator's path decides decode before prefill, as decide_all does.
    body = {
        "model": {"path": "x"},
        "mode": "Disaggregated",
        "prefill": {"maxReplicas": 8},
        "decode": {"maxReplicas": 2},
    }
    spec = validate_spec(body, name="m")
    role_pods, loads = [], {}
    for subnet, (role, busy) in enumerate(((RoleName.PREFILL, 0.95), (RoleName.DECODE, 1.0))):
        for pod in pods(2, role=role, subnet=subnet):
            name = pod["metadata"]["name"]
            role_pods.append(pod)
            loads[name] = PodSample(name, True, 0.0, busy, 20, 0, 0, 8192)
    replicas = {RoleName.PREFILL: 2, RoleName.DECODE: 2}
    behind = QueueState(dict.fromkeys(PRIORITIES, 0), 0, 80_000, 40, 0)
    out = evaluate(spec, replicas, role_pods, loads, behind, ScalerMemory(), 1000.0)
    assert list(out.decisions) == [RoleName.PREFILL, RoleName.DECODE]  # the spec's order
    prefill = out.decisions[RoleName.PREFILL]
    assert prefill.replicas == 2 and "held: decode is at maxReplicas 2" in prefill.reason
