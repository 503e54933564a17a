"""Workload: the requests a simulation replays, from a JSONL trace or from distributions.

A trace (tandem/trace.py) has one JSON object per line, shared with `tandem bench --trace`:

    {"arrival_s": 0.0, "input_tokens": 1024, "output_tokens": 300}

Synthetic workloads draw arrivals (Poisson, or bursty: gamma inter-arrival
times with a coefficient of variation above 1) and lengths (the specs of
tandem/lengths.py, shared with `tandem bench`) from a seeded numpy Generator,
so the same seed gives the same requests. day_trace() builds the autoscaling
study's day: a diurnal rate with random bursts on top, drawn by thinning a
Poisson process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tandem.lengths import LengthDist
from tandem.trace import TraceRequest

__all__ = ["LengthDist", "arrivals", "day_trace", "sample_lengths", "synthesize"]

# At cv 10 (gamma shape 0.01) 90 % of gaps are under a thousandth of the mean:
# requests come in bursts of about 10 at once. At 30, bursts of about 70; at
# 1000 a short run is one burst of thousands or nothing: not a workload.
MAX_CV = 10.0
# The most requests a synthesized workload holds (--rate x --duration): ten million
# simulate for hours, and the arrival draws alone of 1e5 x 1e5 asked for 89 GiB.
MAX_REQUESTS = 10_000_000


def sample_lengths(dist: LengthDist, rng: np.random.Generator, n: int) -> np.ndarray:
    """n lengths of `dist` drawn with numpy (the bench draws with random: dist.sample)."""
    if dist.kind == "fixed":
        values = np.full(n, dist.a)
    elif dist.kind == "uniform":
        values = rng.integers(int(dist.a), int(dist.b), n, endpoint=True)
    elif dist.kind == "normal":
        values = rng.normal(dist.a, dist.b, n)
    else:
        values = rng.lognormal(dist.mu, dist.b, n)
    # Rounded and clipped as LengthDist.sample does it (np.rint and round: half to even).
    return np.clip(np.rint(values), dist.low, dist.high).astype(np.int64)


def arrivals(
    rng: np.random.Generator, rate: float, duration_s: float, cv: float = 1.0
) -> np.ndarray:
    """Arrival times in [0, duration): Poisson at cv 1, burstier (gamma gaps) above.

    Stationary: the first arrival is drawn as if the process had been running
    before 0 (a uniform share of a length-biased gap), so the expected count is
    rate x duration for any cv; starting at an arrival instead adds (cv^2 - 1) / 2
    requests in a burst at the start."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"--rate must be a finite number > 0 requests/s, got {rate!r}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"--duration must be a finite number > 0 s, got {duration_s!r}")
    if not 0 < cv <= MAX_CV:
        raise ValueError(f"--cv must be in (0, {MAX_CV:g}], got {cv!r}")
    if rate * duration_s > MAX_REQUESTS:
        raise ValueError(
            f"--rate {rate:g} x --duration {duration_s:g} is {rate * duration_s:,.0f} "
            f"requests; a workload holds at most {MAX_REQUESTS:,}"
        )
    shape = 1.0 / cv**2  # gamma with mean 1/rate and coefficient of variation cv
    scale = 1.0 / (rate * shape)
    times: list[np.ndarray] = []
    last = 0.0
    if cv != 1.0:  # exponential gaps are memoryless: the plain first gap is stationary
        last = float(rng.uniform() * rng.gamma(shape + 1.0, scale))
        times.append(np.array([last]))
    expected = int(rate * duration_s * 1.2 + 20)
    while last < duration_s:
        chunk = last + np.cumsum(rng.gamma(shape, scale, expected))
        times.append(chunk)
        last = float(chunk[-1])
    out = np.concatenate(times)
    return out[out < duration_s]


def synthesize(
    *,
    rate: float,
    duration_s: float,
    input_len: LengthDist,
    output_len: LengthDist,
    cv: float = 1.0,
    seed: int = 0,
) -> list[TraceRequest]:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"--seed must be an integer >= 0, got {seed!r}")
    rng = np.random.default_rng(seed)
    times = arrivals(rng, rate, duration_s, cv)
    n = len(times)
    return _requests(times, sample_lengths(input_len, rng, n), sample_lengths(output_len, rng, n))


def day_trace(
    *,
    mean_rate: float,
    input_len: LengthDist,
    output_len: LengthDist,
    duration_s: float = 86_400.0,
    swing: float = 0.8,
    bursts_per_day: float = 12.0,
    burst_factor: tuple[float, float] = (2.0, 4.0),
    burst_minutes: tuple[float, float] = (5.0, 20.0),
    seed: int = 0,
) -> list[TraceRequest]:
    """A day of traffic: rate(t) = mean x (1 - swing cos(2 pi t / day)) x burst.

    The trough is at midnight (t = 0), the peak at noon. Bursts start as a Poisson
    process, each multiplying the rate by a factor drawn from `burst_factor` for
    a duration drawn from `burst_minutes` (overlapping bursts: the larger factor).
    Arrivals are drawn by thinning a Poisson process at the peak rate.
    """
    if not 0 <= swing < 1:
        raise ValueError(f"swing must be in [0, 1), got {swing}")
    rng = np.random.default_rng(seed)
    n_bursts = rng.poisson(bursts_per_day * duration_s / 86_400.0)
    starts = np.sort(rng.uniform(0, duration_s, n_bursts))
    lengths = rng.uniform(*burst_minutes, n_bursts) * 60
    factors = rng.uniform(*burst_factor, n_bursts)
    peak = mean_rate * (1 + swing) * (float(factors.max()) if n_bursts else 1.0)
    candidates = arrivals(rng, peak, duration_s)
    rate = rate_at(candidates, mean_rate, swing, duration_s, starts, lengths, factors)
    kept = candidates[rng.uniform(0, peak, len(candidates)) < rate]
    n = len(kept)
    return _requests(kept, sample_lengths(input_len, rng, n), sample_lengths(output_len, rng, n))


def rate_at(
    t: np.ndarray,
    mean_rate: float,
    swing: float,
    period_s: float,
    starts: Sequence[float],
    lengths: Sequence[float],
    factors: Sequence[float],
) -> np.ndarray:
    """The day trace's intended rate at times t (overlapping bursts: the larger factor)."""
    boost = np.ones_like(t)
    for start, length, factor in zip(starts, lengths, factors, strict=True):
        inside = (t >= start) & (t < start + length)
        boost = np.where(inside, np.maximum(boost, factor), boost)
    return mean_rate * (1 - swing * np.cos(2 * np.pi * t / period_s)) * boost


def _requests(times: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> list[TraceRequest]:
    return [
        TraceRequest(float(t), int(i), int(o))
        for t, i, o in zip(times.tolist(), inputs.tolist(), outputs.tolist(), strict=True)
    ]
