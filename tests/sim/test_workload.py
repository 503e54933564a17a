"""Traces and synthetic workloads."""

import random

import numpy as np
import pytest

from tandem.sim.workload import LengthDist, arrivals, day_trace, sample_lengths, synthesize
from tandem.trace import TraceRequest, read_trace, write_trace


def _chat(seed=0, rate=5.0, duration=60.0):
    return synthesize(
        rate=rate,
        duration_s=duration,
        input_len=LengthDist.parse("lognormal:1000:0.5"),
        output_len=LengthDist.parse("uniform:100:300"),
        seed=seed,
    )


def test_trace_round_trip(tmp_path):
    requests = _chat()
    path = tmp_path / "trace.jsonl"
    write_trace(path, requests)
    again = read_trace(path)
    assert [(r.input_tokens, r.output_tokens) for r in again] == [
        (r.input_tokens, r.output_tokens) for r in requests
    ]
    assert [r.arrival_s for r in again] == [r.arrival_s for r in requests]


def test_a_bad_line_is_named(tmp_path):
    path = tmp_path / "trace.jsonl"
    good = '{"arrival_s": 0, "input_tokens": 10, "output_tokens": 5}'
    path.write_text(good + '\n\n{"arrival_s": 1,\n')
    with pytest.raises(ValueError, match=r"line 3: not valid JSON"):
        read_trace(path)
    path.write_text('{"arrival_s": 0, "input_tokens": 10}\n')
    with pytest.raises(ValueError, match=r"line 1: missing output_tokens"):
        read_trace(path)
    path.write_text('{"arrival_s": 0, "input_tokens": 0, "output_tokens": 5}\n')
    with pytest.raises(ValueError, match=r"line 1: input_tokens must be an integer in 1\.\."):
        read_trace(path)
    # Past the length specs' bound, found mid-run: an OverflowError, or a prompt of
    # 20 million ids built and sent.
    path.write_text('{"arrival_s": 0, "input_tokens": 10, "output_tokens": 99999999999}\n')
    with pytest.raises(ValueError, match=r"line 1: output_tokens must be an integer in 1\.\."):
        read_trace(path)


def test_unsorted_traces_are_sorted(tmp_path):
    path = tmp_path / "trace.jsonl"
    write_trace(path, [TraceRequest(2.0, 5, 5), TraceRequest(1.0, 6, 6)])
    assert [r.arrival_s for r in read_trace(path)] == [1.0, 2.0]


def test_synthetic_workloads_are_seeded():
    assert _chat(seed=3) == _chat(seed=3)
    assert _chat(seed=3) != _chat(seed=4)


def test_poisson_rate_and_bursty_variation():
    rng = np.random.default_rng(0)
    poisson = arrivals(rng, rate=50.0, duration_s=200.0)
    bursty = arrivals(rng, rate=50.0, duration_s=200.0, cv=3.0)
    assert len(poisson) == pytest.approx(10_000, rel=0.05)
    gaps_p, gaps_b = np.diff(poisson), np.diff(bursty)
    assert gaps_p.std() / gaps_p.mean() == pytest.approx(1.0, rel=0.1)
    assert gaps_b.std() / gaps_b.mean() > 2.0


def test_bursty_runs_offer_rate_times_duration_and_cv_is_bounded():
    # Starting at an arrival added (cv^2 - 1) / 2 requests in a burst at t = 0: at
    # cv 10, 55 requests on average for 5 s at 1 req/s. The stationary start keeps
    # the mean at rate x duration.
    rng = np.random.default_rng(1)
    counts = [len(arrivals(rng, rate=1.0, duration_s=5.0, cv=5.0)) for _ in range(4000)]
    assert np.mean(counts) == pytest.approx(5.0, rel=0.15)
    for cv in (30.0, 1e6):  # 1e6 used to run forever
        with pytest.raises(ValueError, match=r"--cv must be in \(0, 10\]"):
            arrivals(rng, rate=1.0, duration_s=5.0, cv=cv)


def test_poisson_arrivals_keep_their_stream():
    # The studies' workloads (Poisson) are the ones their documented tables came from.
    times = arrivals(np.random.default_rng(0), rate=2.0, duration_s=3.0)
    expected = [0.34, 0.8498, 0.8597, 0.8608, 1.136, 1.9509, 2.2877, 2.6654]
    assert times.tolist() == pytest.approx(expected, abs=1e-4)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert set(sample_lengths(LengthDist.parse("7"), rng, 10).tolist()) == {7}
    lognormal = sample_lengths(LengthDist.parse("lognormal:1000:0.5"), rng, 20_000)
    assert lognormal.mean() == pytest.approx(1000, rel=0.03)
    with pytest.raises(ValueError, match="normal:MEAN:SPREAD"):
        LengthDist.parse("normal:5")
    with pytest.raises(ValueError, match="a fixed length is one integer"):
        LengthDist.parse("1.5")


@pytest.mark.parametrize(
    "spec", ["uniform:3:6", "normal:100:30:80:110", "lognormal:50:0.5", "lognormal:50:1:1:200"]
)
def test_sim_and_bench_read_a_spec_alike(spec):
    """One parser, one meaning: the simulator's numpy draws and the bench's random
    draws of the same spec keep to its bounds and have the same mean and spread."""
    dist = LengthDist.parse(spec)
    sim = sample_lengths(dist, np.random.default_rng(0), 20_000)
    rng = random.Random(0)
    bench = np.array([dist.sample(rng) for _ in range(20_000)])
    for draws in (sim, bench):
        assert dist.low <= draws.min() and draws.max() <= dist.high
    assert sim.mean() == pytest.approx(bench.mean(), rel=0.02)
    assert sim.std() == pytest.approx(bench.std(), rel=0.05)


def test_a_negative_seed_is_named():
    with pytest.raises(ValueError, match="--seed must be an integer >= 0, got -1"):
        synthesize(
            rate=1.0,
            duration_s=1.0,
            input_len=LengthDist.parse("10"),
            output_len=LengthDist.parse("10"),
            seed=-1,
        )


def test_day_trace_peaks_at_noon():
    day = day_trace(
        mean_rate=0.5,
        input_len=LengthDist.parse("100"),
        output_len=LengthDist.parse("10"),
        bursts_per_day=0,
        seed=1,
    )
    hours = np.array([r.arrival_s for r in day]) // 3600
    night, noon = (hours < 2).sum(), ((hours >= 11) & (hours < 13)).sum()
    assert noon > 4 * night
