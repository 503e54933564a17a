"""Arrival processes: when requests are sent, as offsets in seconds from the run's start.

Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean
1 / rate (vLLM's benchmark uses the same convention, so figures compare):
burstiness 1 is a Poisson process (exponential gaps, coefficient of variation
1); below 1 the gaps vary more (bursts and lulls, CV = 1 / sqrt(burstiness));
above 1 they are more regular. The generators are infinite and pure given
their `random.Random`: the caller decides when to stop (a count, a duration).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def check_rate(rate: float, burstiness: float) -> None:
    if not rate > 0:  # also refuses NaN
        raise ValueError(f"--rate must be > 0 requests/s (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a finite number > 0, got {burstiness}")
    if math.isfinite(rate):
        # A mean gap that overflows (a rate of 1e-320) or a gamma scale that underflows
        # to 0 (1e308 x 1e300) is no workload, and failed later in words of gamma's.
        scale = 1.0 / (rate * burstiness) if math.isfinite(rate * burstiness) else 0.0
        if not (math.isfinite(1.0 / rate) and scale > 0):
            raise ValueError(
                f"--rate {rate:g} with --burstiness {burstiness:g} is out of range: "
                "the gaps between requests would be infinite or zero"
            )


def arrival_offsets(
    rate: float, burstiness: float, rng: random.Random, *, stationary: bool = False
) -> Iterator[float]:
    """Offsets 0 <= t0 <= t1 <= ... ; rate inf: everything at 0 (the concurrency limit paces).

    `stationary` (for runs of a set duration) starts as if arrivals had run before 0, so
    the run offers rate x duration; otherwise (a set count) the first gap is a plain one,
    not an idle wait that at small burstiness lasts minutes."""
    check_rate(rate, burstiness)
    now = 0.0
    if math.isinf(rate):
        while True:
            yield 0.0
    # Gamma(shape k, scale θ) has mean kθ: θ = 1 / (rate k) gives mean gap 1 / rate.
    scale = 1.0 / (rate * burstiness)
    if stationary and burstiness != 1.0:
        # Stationary, as the simulator draws it: the first arrival is a uniform share
        # of a length-biased gap, as if the process had run before 0. A plain first gap
        # started at an arrival: (1/k - 1) / 2 requests more in a burst at the start
        # (at --burstiness 0.01, 40 % more than asked over a minute at rate 2).
        now = rng.random() * rng.gammavariate(burstiness + 1.0, scale)
        yield now
    # Exponential gaps are memoryless: the plain first gap is stationary already.
    while True:
        now += rng.gammavariate(burstiness, scale)
        yield now


def coefficient_of_variation(offsets: list[float]) -> float:
    """Std / mean of the gaps between offsets: 1 for Poisson, more for bursty arrivals."""
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets, strict=False)]
    if len(gaps) < 2:
        raise ValueError("need at least two arrivals")
    mean = sum(gaps) / len(gaps)
    variance = sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)
    return math.sqrt(variance) / mean
