"""Arrival processes: Poisson rate and variability, bursty arrivals, seeding, bad arguments."""

import itertools
import math
import random

import pytest

from tandem.loadgen.arrivals import arrival_offsets, coefficient_of_variation

N = 4000


def take(rate, burstiness, seed, n=N):
    return list(itertools.islice(arrival_offsets(rate, burstiness, random.Random(seed)), n))


def test_poisson_mean_rate_is_within_statistical_bounds():
    rate = 20.0
    offsets = take(rate, 1.0, seed=1)
    mean_gap = offsets[-1] / N
    # Exponential gaps: the mean of N has standard error (1 / rate) / sqrt(N);
    # 4 standard errors fail a correct generator about once in 16,000 seeds.
    assert abs(mean_gap - 1 / rate) < 4 * (1 / rate) / math.sqrt(N)
    assert offsets == sorted(offsets) and offsets[0] > 0


def test_poisson_gaps_have_a_coefficient_of_variation_near_one():
    # The CV estimate of N exponential gaps has standard error about 1 / sqrt(N) = 0.016.
    assert abs(coefficient_of_variation(take(5.0, 1.0, seed=2)) - 1.0) < 0.08


def test_bursty_arrivals_keep_the_rate_and_vary_more():
    poisson = take(10.0, 1.0, seed=3)
    bursty = take(10.0, 0.25, seed=3)
    # Gamma shape k: CV = 1 / sqrt(k) = 2 for k = 0.25.
    assert coefficient_of_variation(bursty) > 1.6
    assert coefficient_of_variation(bursty) > coefficient_of_variation(poisson) + 0.5
    # Same mean rate (the bursty mean converges slower: CV 2, so 4 x 2 standard errors).
    assert abs(bursty[-1] / N - 0.1) < 8 * 0.1 / math.sqrt(N)


@pytest.mark.parametrize("burstiness", [0.01, 0.25, 4.0])
def test_a_run_of_any_burstiness_offers_rate_times_duration(burstiness):
    # The first gap started at an arrival: at burstiness 0.01, 167 requests where 120
    # were asked over a minute at rate 2, most of them in the first seconds.
    rate, duration, runs = 2.0, 60.0, 2000

    def count(seed: int) -> int:
        offsets = arrival_offsets(rate, burstiness, random.Random(seed), stationary=True)
        return sum(1 for _ in itertools.takewhile(lambda t: t < duration, offsets))

    mean = sum(count(seed) for seed in range(runs)) / runs
    # A run's count has variance about rate x duration / burstiness (12,000 at 0.01):
    # the mean of 2,000 runs is off by at most 2.5 standard errors, 10 at most.
    assert abs(mean - rate * duration) < 10, mean


def test_a_run_of_a_set_count_sends_its_first_request_after_one_plain_gap():
    # Stationary, a count-bounded run waited out a length-biased share of a gap first
    # (at burstiness 0.001 and rate 2 a median of minutes) sending nothing.
    firsts = sorted(take(2.0, 0.001, seed, n=1)[0] for seed in range(200))
    assert firsts[100] < 0.01  # gamma(0.001) gaps: almost all tiny


def test_burstiness_above_one_is_more_regular_than_poisson():
    assert coefficient_of_variation(take(10.0, 4.0, seed=4)) < 0.6


def test_same_seed_same_arrivals_other_seed_other_arrivals():
    assert take(3.0, 1.0, seed=7, n=50) == take(3.0, 1.0, seed=7, n=50)
    assert take(3.0, 1.0, seed=7, n=50) != take(3.0, 1.0, seed=8, n=50)


def test_infinite_rate_sends_everything_at_once():
    assert take(math.inf, 1.0, seed=0, n=5) == [0.0] * 5


@pytest.mark.parametrize(
    ("rate", "burstiness", "message"),
    [
        (0.0, 1.0, "--rate"),
        (-1.0, 1.0, "--rate"),
        (math.nan, 1.0, "--rate"),
        (1.0, 0.0, "--burstiness"),
        (1.0, math.inf, "--burstiness"),
        (1e-320, 1.0, "with --burstiness 1 is out of range"),  # 1e-320 is subnormal
        (1e308, 1e300, "--rate 1e.308 with --burstiness 1e.300 is out of range"),
    ],
)
def test_bad_arguments_are_named(rate, burstiness, message):
    with pytest.raises(ValueError, match=message):
        next(arrival_offsets(rate, burstiness, random.Random(0)))
