"""Workloads: seeded and reproducible; a trace replayed at a chosen speed."""

import itertools

import pytest

from tandem.lengths import parse_length
from tandem.loadgen.prompts import fit_calibration, request_rng, token_ids
from tandem.loadgen.workload import synthetic_workload, trace_workload
from tandem.trace import TraceRequest


def first(n, **kwargs):
    args = dict(rate=5.0, burstiness=1.0, seed=3)
    args |= kwargs
    inputs = parse_length(args.pop("inputs", "uniform:1:100"))
    outputs = parse_length(args.pop("outputs", "lognormal:20:0.5"))
    return list(
        itertools.islice(synthetic_workload(input_tokens=inputs, output_tokens=outputs, **args), n)
    )


def test_one_seed_one_workload_and_lengths_do_not_move_arrivals():
    assert first(30) == first(30)
    assert first(30) != first(30, seed=4)
    other_lengths = first(30, inputs="normal:50:5")
    assert [r.arrival_s for r in other_lengths] == [r.arrival_s for r in first(30)]
    assert [r.input_tokens for r in other_lengths] != [r.input_tokens for r in first(30)]


def test_a_trace_replayed_twice_as_fast():
    trace = [TraceRequest(0.0, 1, 2), TraceRequest(3.0, 4, 5)]
    assert list(trace_workload(trace, 0.5)) == [TraceRequest(0.0, 1, 2), TraceRequest(1.5, 4, 5)]


def test_prompts_depend_on_seed_and_index_not_on_order():
    a = token_ids(20, request_rng(0, 5), 10, 499)
    assert a == token_ids(20, request_rng(0, 5), 10, 499)
    assert a != token_ids(20, request_rng(0, 6), 10, 499)
    assert len(a) == 20 and all(10 <= t <= 499 for t in a)


def test_text_calibration_fits_the_servers_counts():
    # A server that adds 5 template tokens and counts 1.25 tokens per word.
    calibration = fit_calibration([(50, 5 + 62.5), (200, 5 + 250)])
    assert calibration.intercept == 5 and calibration.per_word == 1.25
    assert calibration.words_for(130) == 100
    assert calibration.words_for(1) == 1  # never an empty prompt


def test_calibration_needs_two_word_counts_and_a_positive_slope():
    with pytest.raises(ValueError, match="two different word counts"):
        fit_calibration([(50, 60), (50, 61)])
    with pytest.raises(ValueError, match="tokens per word"):
        fit_calibration([(50, 60), (200, 60)])
