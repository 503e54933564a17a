"""The simulated cluster: conservation, determinism, the real scheduler's rules, disaggregation."""

import dataclasses
import statistics

import pytest
from support.imports import packages_loaded

from tandem.engine.scheduler import Scheduler
from tandem.sim import deployment as deploy
from tandem.sim.cluster import ClusterConfig, simulate
from tandem.sim.devices import H200
from tandem.sim.model_shapes import model_shape
from tandem.sim.summary import SLO, summarize
from tandem.sim.workload import LengthDist, synthesize
from tandem.trace import TraceRequest

LLAMA_8B = model_shape("llama-8b")


def _workload(rate=20.0, duration=20.0, seed=0, prompt="lognormal:1000:0.5", out="uniform:50:200"):
    return synthesize(
        rate=rate,
        duration_s=duration,
        input_len=LengthDist.parse(prompt, cap=8000),
        output_len=LengthDist.parse(out),
        seed=seed,
    )


def _run(deployment, requests, **kwargs):
    return simulate(ClusterConfig(deployment, H200, LLAMA_8B, **kwargs), requests)


def _mean_ttft(result):
    return statistics.mean(r.ttft_s for r in result.records if r.finished)


def test_every_request_finishes_or_is_reported_failed():
    requests = [*_workload(duration=10.0), TraceRequest(5.0, 9000, 10)]  # over the limit
    requests.sort(key=lambda r: r.arrival_s)
    for deployment in (deploy.normal(2), deploy.disaggregated(1, 1)):
        result = _run(deployment, requests)
        summary = summarize(result, SLO())
        assert summary.finished + summary.failed == len(requests)
        assert summary.failed == 1 and summary.unfinished == 0
        failed = next(r for r in result.records if r.failure)
        assert failed.failure.startswith("prompt over 8191 tokens")
        assert summary.failures == {failed.failure: 1}
        for r in result.records:
            if r.finished:
                assert r.arrival_s <= r.first_token_s <= r.finish_s


def test_a_run_stopped_early_reports_the_rest_unfinished():
    requests = _workload(duration=10.0)
    result = _run(deploy.normal(1), requests, max_time_s=5.0)
    summary = summarize(result, SLO())
    assert summary.unfinished > 0
    arrived = sum(1 for r in requests if r.arrival_s <= 5.0)  # the rest were never sent
    assert summary.finished + summary.failed + summary.unfinished == arrived < len(requests)


def test_same_seed_same_result():
    a = _run(deploy.disaggregated(1, 1), _workload(seed=7))
    b = _run(deploy.disaggregated(1, 1), _workload(seed=7))
    assert [(r.first_token_s, r.finish_s) for r in a.records] == [
        (r.first_token_s, r.finish_s) for r in b.records
    ]


def test_disaggregation_moves_kv_before_decoding():
    # One request: the decoder's first step waits for its KV, which takes bytes / bandwidth.
    request = [TraceRequest(0.0, 4000, 3)]
    fast = _run(deploy.disaggregated(1, 1), request)
    slow_network = dataclasses.replace(
        ClusterConfig(deploy.disaggregated(1, 1), H200, LLAMA_8B),
    )
    slow = simulate(
        dataclasses.replace(
            slow_network, network=dataclasses.replace(slow_network.network, bandwidth=1e8)
        ),
        request,
    )
    kv_bytes = 4000 * LLAMA_8B.kv_bytes_per_token
    assert slow.records[0].ttft_s == pytest.approx(fast.records[0].ttft_s)
    extra = slow.records[0].finish_s - fast.records[0].finish_s
    assert extra == pytest.approx(kv_bytes / 1e8 - kv_bytes / 50e9, rel=0.01)


def test_the_prefill_attempt_interval_rule_drives_ttft():
    # One busy Normal engine: new prompts wait for the next attempt point, so
    # shorter intervals (a config rule of the real scheduler) mean shorter TTFT.
    requests = _workload(rate=8.0, duration=30.0)
    rare = _run(deploy.normal(1), requests)  # defaults: 70 / 100
    often = _run(
        deploy.normal(1, engine={"prefill_attempt_interval": 5, "prefill_any_attempt_interval": 8}),
        requests,
    )
    assert _mean_ttft(often) < 0.5 * _mean_ttft(rare)


def test_a_patched_scheduler_method_changes_the_result(monkeypatch):
    # A stricter "wants prefill" rule (only when nothing runs) makes prompts wait
    # for every running request to finish: TTFT rises, decode runs undisturbed.
    requests = _workload(rate=8.0, duration=20.0)
    before = _run(deploy.normal(1), requests)
    original = Scheduler._wants_prefill
    monkeypatch.setattr(
        Scheduler, "_wants_prefill", lambda self: not self.running and original(self)
    )
    after = _run(deploy.normal(1), requests)
    assert all(r.finished for r in after.records)
    assert _mean_ttft(after) > 2 * _mean_ttft(before)
    tpot = [statistics.mean(r.tpot_s for r in x.records) for x in (before, after)]
    assert tpot[1] < tpot[0]


def test_data_parallel_ranks_vote_in_lockstep():
    requests = _workload(rate=10.0, duration=5.0)
    result = _run(deploy.normal(1, engine={"data_parallel_size": 2}), requests)
    assert all(r.finished for r in result.records)
    assert result.pods[0].gpus == 2


def test_the_autoscaler_scales_up_under_a_burst_and_down_after():
    # Long prompts, short answers: the queued prompt tokens ask for more pods.
    burst = _workload(rate=25.0, duration=60.0, prompt="4000", out="uniform:10:30")
    role = deploy.role_setup(
        "normal",
        replicas=1,
        min_replicas=1,
        max_replicas=6,
        policy={"scale_down_stabilization_seconds": 120.0},
    )
    result = _run(deploy.Deployment({role.role: role}), burst, startup_s=20.0, until_s=900.0)
    desired = [p.desired for p in result.timeline]
    assert max(desired) > 1
    assert desired[-1] == 1
    ups = [e for e in result.scale_events if e.to_replicas > e.from_replicas]
    downs = [e for e in result.scale_events if e.to_replicas < e.from_replicas]
    assert ups and downs and ups[0].time_s < downs[-1].time_s
    assert all(r.finished for r in result.records)
    fixed = _run(deploy.normal(max(desired)), burst, until_s=900.0)
    assert result.gpu_seconds < fixed.gpu_seconds


def test_prefill_settles_under_a_steady_load_instead_of_cycling():
    # Prompts well under the budget: each pod's steps part-full. Read as fill x busy,
    # 8 pods' load asked 0.19 of a pod, the role fell to 1, its queue grew, and it
    # climbed back to 8: a cycle of minutes, for as long as the load held.
    steady = _workload(rate=20.0, duration=700.0, out="uniform:20:60")  # prefill-bound
    roles = [
        deploy.role_setup(name, replicas=1, min_replicas=1, max_replicas=8, tp=4)
        for name in ("prefill", "decode")
    ]
    deployment = deploy.Deployment({role.role: role for role in roles})
    result = simulate(ClusterConfig(deployment, H200, model_shape("llama-70b")), steady)
    prefill = [(e.from_replicas, e.to_replicas) for e in result.scale_events if e.role == "prefill"]
    downs = [i for i, (a, b) in enumerate(prefill) if b < a]
    assert downs, "the start-up backlog's pods are given back"
    assert all(b < a for a, b in prefill[downs[0] :]), f"down then up again: {prefill}"
    assert prefill[-1][1] >= 2  # ~1.2 pods' time stepping, at the 70 % target


def test_the_simulator_imports_no_io_client():
    # It runs the operator's autoscaler and scaling glue, never their HTTP or Redis clients.
    io = {"httpx", "redis", "prometheus_client", "kopf", "kubernetes"}
    assert packages_loaded("import tandem.sim.main", io) == []


def test_an_idle_stretch_adds_no_timeline_points():
    # One point per role and tick through a quiet day (memory grew with the gap): now a
    # point where the counts change, and at the start and the end.
    quiet = [TraceRequest(0.0, 100, 10), TraceRequest(86_400.0, 100, 10)]
    role = deploy.role_setup("normal", replicas=1, min_replicas=1, max_replicas=2)
    result = _run(deploy.Deployment({role.role: role}), quiet)
    assert all(r.finished for r in result.records)
    assert len(result.timeline) < 10
    assert result.timeline[-1].time_s == result.end_s


def test_pods_ready_at_once_take_the_work_already_queued():
    # --startup-s 0: a pod spawned ready waited for the next arrival before its first
    # turn, so from zero pods a lone request was never served (the run never ended),
    # and pods added under a burst were charged GPU-hours and never stepped.
    lone = [TraceRequest(0.0, 1000, 50)]
    role = deploy.role_setup("normal", replicas=0, min_replicas=0, max_replicas=1)
    zero = deploy.Deployment({role.role: role})
    assert all(r.finished for r in _run(zero, lone, startup_s=0.0, max_time_s=600.0).records)

    burst = [TraceRequest(i / 400, 2000, 200) for i in range(400)]
    scaled = deploy.normal(1, tp=4, min_replicas=1, max_replicas=4)
    seventy_b = ClusterConfig(scaled, H200, model_shape("llama-70b"))
    ends = {}
    for startup in (0.0, 1.0):
        result = simulate(dataclasses.replace(seventy_b, startup_s=startup), burst)
        assert all(r.finished for r in result.records)
        ends[startup] = max(r.finish_s for r in result.records)
    assert ends[0.0] <= ends[1.0]  # ready sooner serves sooner (it took 53 s against 28)


def test_handoffs_go_to_the_decoder_idle_longest():
    # A decoder that took a handoff kept its place at the head of the idle queue while
    # its KV came, and took the next one too: the transfers queued on its one link
    # while the other decoder idled.
    from tandem.sim.network import Network

    requests = [TraceRequest(0.0, 4000, 2), TraceRequest(0.01, 4000, 2)]
    slow = Network(bandwidth=1e9, latency_s=0.001)
    result = _run(deploy.disaggregated(2, 2), requests, network=slow)
    decoding = [r.finish_s - r.first_token_s for r in result.records]
    assert max(decoding) < 1.2 * min(decoding), decoding  # was 0.53 and 1.05 s


def test_an_autoscaled_run_says_pods_ready_when_they_are_and_ends_at_its_last_answer():
    # Pods ready between ticks showed a tick late (15 s), and the tick pushed while
    # work was left ran after the last answer, every pod billed to it.
    burst = _workload(rate=40.0, duration=60.0, prompt="3000", out="200")
    scaled = deploy.normal(1, min_replicas=1, max_replicas=4)
    result = _run(scaled, burst, startup_s=20.0)
    started = [life for life in result.pods if life.ready_s > 0]
    assert started, "pods were added"
    points = {p.time_s for p in result.timeline}
    assert all(life.ready_s in points for life in started)
    assert result.end_s == max(r.finish_s for r in result.records)
