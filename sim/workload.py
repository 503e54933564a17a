"""Workload: the requests a simulation replays, from a JSONL trace or from distributions.

A trace (tandem/trace.py) has one JSON object per line, shared with `tandem bench --trace`:

    {"arrival_s": 0.0, "input_tokens": 1024, "output_tokens": 300}

Synthetic workloads draw arrivals (Poisson, or bursty: gamma inter-arrival
times with a coefficient of variation above 1) and lengths (fixed, uniform,
lognormal) from a seeded numpy Generator, so the same seed gives the same
requests. day_trace() builds the autoscaling study's day: a diurnal rate with
random bursts on top, drawn by thinning a Poisson process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.trace import TraceRequest

# ---------------------------------------------------------- distributions


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: "1000" (fixed), "uniform:500:1500", "lognormal:1000:0.5" (mean, sigma)."""

    kind: str
    # fixed: the length; uniform: low; lognormal: the mean.
    a: float
    # uniform: high; lognormal: sigma of the underlying normal; fixed: unused.
    b: float = 0.0
    # Lengths are clipped to [1, cap].
    cap: int = 1 << 20

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length distribution must be fixed, uniform or lognormal: {self}")
        if not self.a >= 1 or (self.kind == "uniform" and self.b < self.a) or self.b < 0:
            raise ValueError(f"bad length distribution parameters: {self}")

    @classmethod
    def parse(cls, text: str, cap: int = 1 << 20) -> LengthDist:
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]), cap=cap)
            if len(parts) == 3 and parts[0] in ("uniform", "lognormal"):
                return cls(parts[0], float(parts[1]), float(parts[2]), cap=cap)
        except ValueError:
            pass
        raise ValueError(
            f"length {text!r}: use N, uniform:LOW:HIGH or lognormal:MEAN:SIGMA (e.g. "
            "lognormal:1000:0.5)"
        )

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            values = np.full(n, self.a)
        elif self.kind == "uniform":
            values = rng.uniform(self.a, self.b, n)
        else:  # mean-preserving: E[exp(N(mu, s^2))] = exp(mu + s^2 / 2)
            mu = math.log(self.a) - self.b**2 / 2
            values = rng.lognormal(mu, self.b, n)
        return np.clip(np.rint(values), 1, self.cap).astype(np.int64)


def arrivals(
    rng: np.random.Generator, rate: float, duration_s: float, cv: float = 1.0
) -> np.ndarray:
    """Arrival times in [0, duration): Poisson at cv 1, burstier (gamma gaps) above."""
    if not rate > 0 or not duration_s > 0 or not cv > 0:
        raise ValueError(f"rate, duration and cv must be positive: {rate}, {duration_s}, {cv}")
    shape = 1.0 / cv**2  # gamma with mean 1/rate and coefficient of variation cv
    expected = int(rate * duration_s * 1.2 + 20)
    times: list[np.ndarray] = []
    last = 0.0
    while last < duration_s:
        gaps = rng.gamma(shape, 1.0 / (rate * shape), expected)
        chunk = last + np.cumsum(gaps)
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
    rng = np.random.default_rng(seed)
    times = arrivals(rng, rate, duration_s, cv)
    return _requests(times, input_len.sample(rng, len(times)), output_len.sample(rng, len(times)))


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
    return _requests(kept, input_len.sample(rng, len(kept)), output_len.sample(rng, len(kept)))


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
