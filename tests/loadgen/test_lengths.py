"""Length specs: each kind samples within its bounds; bad specs name the flag and the problem."""

import random
import statistics

import pytest

from tandem.loadgen.lengths import LengthDist, parse_length


def sample(spec, n=2000, seed=0):
    dist = parse_length(spec)
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


def test_fixed():
    assert parse_length("128") == LengthDist("fixed", 128, low=128, high=128)
    assert set(sample("128", n=10)) == {128}


def test_uniform_covers_its_inclusive_range():
    values = sample("uniform:3:6")
    assert set(values) == {3, 4, 5, 6}


def test_normal_is_centred_and_clipped_to_its_bounds():
    values = sample("normal:100:30:80:110")
    assert min(values) == 80 and max(values) == 110
    unclipped = sample("normal:100:10")
    assert abs(statistics.mean(unclipped) - 100) < 1.5


def test_lognormal_has_its_median_and_is_at_least_one():
    values = sample("lognormal:50:1.0")
    assert 45 <= statistics.median(values) <= 55
    assert min(values) >= 1
    assert max(sample("lognormal:50:1.0:1:200")) <= 200


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("0", "fixed length"),
        ("1.5", "fixed length"),
        ("abc", "numbers expected"),
        ("uniform:9:3", "LOW <= HIGH"),
        ("uniform:5", "LOW <= HIGH"),
        ("normal:10", "normal:A:B"),
        ("normal:10:-1", "spread"),
        ("lognormal:0:1", "median"),
        ("normal:10:2:5:1", "MIN <= MAX"),
        ("zipf:1:2", "unknown kind 'zipf'"),
        ("uniform:1:inf", "finite"),
    ],
)
def test_bad_specs_name_the_flag_and_the_problem(spec, problem):
    with pytest.raises(ValueError, match="--input-tokens") as info:
        parse_length(spec, "--input-tokens")
    assert problem in str(info.value)
