"""Length specs: each kind samples within its bounds; bad specs name the flag and the problem."""

import random
import statistics

import pytest

from tandem.lengths import LengthDist, parse_length


def sample(spec, n=2000, seed=0):
    dist = parse_length(spec)
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(n)]


def test_fixed():
    assert parse_length("128") == LengthDist("fixed", 128, low=128, high=128)
    assert set(sample("128", n=10)) == {128}
    assert parse_length("1e3").a == 1000  # an integer, however written


def test_uniform_covers_its_inclusive_range():
    values = sample("uniform:3:6")
    assert set(values) == {3, 4, 5, 6}


def test_normal_is_centred_and_clipped_to_its_bounds():
    values = sample("normal:100:30:80:110")
    assert min(values) == 80 and max(values) == 110
    unclipped = sample("normal:100:10")
    assert abs(statistics.mean(unclipped) - 100) < 1.5


def test_lognormal_has_its_mean_and_is_within_its_bounds():
    # The first number is the mean for every kind (tandem sim's meaning too), so
    # rate x MEAN is the offered token load.
    values = sample("lognormal:50:0.5", n=20_000)
    assert statistics.mean(values) == pytest.approx(50, rel=0.02)
    assert statistics.median(values) == pytest.approx(50 * 0.8825, rel=0.03)  # exp(-s^2/2)
    assert min(values) >= 1
    assert max(sample("lognormal:50:1.0:1:200")) <= 200


def test_one_seed_one_sequence():
    assert sample("lognormal:300:0.5", n=50, seed=4) == sample("lognormal:300:0.5", n=50, seed=4)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("0", "fixed length"),
        ("1.5", "fixed length"),
        ("inf", "finite"),
        ("1e30", "fixed length is one integer in 1..10,000,000"),
        ("abc", "numbers expected"),
        ("uniform:9:3", "LOW <= HIGH"),
        ("uniform:5", "LOW <= HIGH"),
        ("uniform:1.5:3", "integers"),
        ("uniform:5:inf", "finite"),
        ("normal:10", "normal:MEAN:SPREAD"),
        ("normal:10:-1", "spread (STD) must be >= 0"),
        ("lognormal:0:1", "the mean must be within [1, 10,000,000]"),
        ("normal:10:2:5:1", "MIN <= MAX"),
        ("normal:10:2:0:5", "MIN <= MAX"),
        ("normal:3:2:5:10", "the mean must be within [5, 10]"),
        # A mean-preserving log-normal with a huge SIGMA has its median near 0:
        # nearly every length would be MIN (it used to make every length 1).
        ("lognormal:1000:50", "the median is 0"),
        ("lognormal:1000:1e200", "the median is 0"),
        ("zipf:1:2", "unknown kind 'zipf'"),
    ],
)
def test_bad_specs_name_the_flag_and_the_problem(spec, problem):
    with pytest.raises(ValueError, match="--input-tokens") as info:
        parse_length(spec, "--input-tokens")
    assert problem in str(info.value)


def test_a_spec_longer_than_the_model_everywhere_is_refused():
    assert parse_length("lognormal:8000:0.5", cap=8192).a == 8000  # some fit: kept, not clipped
    with pytest.raises(ValueError, match="every length is over 8192 tokens"):
        parse_length("10000", "--input", cap=8192)
    with pytest.raises(ValueError, match="every length is over"):
        parse_length("uniform:9000:9500", cap=8192)
