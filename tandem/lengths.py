"""Token-length specs: one parser and one meaning for `tandem bench` and `tandem sim`.

  `128`                             always 128
  `uniform:LOW:HIGH`                integers LOW..HIGH, uniform
  `normal:MEAN:STD[:MIN:MAX]`       rounded normal
  `lognormal:MEAN:SIGMA[:MIN:MAX]`  rounded log-normal of that mean (SIGMA: of the log)

Lengths are integers; the mean (before clipping) is the first number of a
fixed length, normal and lognormal, and (LOW + HIGH) / 2 of uniform, so rate x
mean is the offered token load. Values outside [MIN, MAX]
(default [1, MAX_LENGTH]) are clipped rather than resampled: the sampler's
cost stays fixed and its output reproducible; the bounds cap a tail, they do
not reshape the distribution, so a spec that would put half its lengths on a
bound is refused. The bench samples with `random.Random` (sample()), the
simulator with numpy (sim/workload.py: sample_lengths); each is reproducible
by its seed, and both round and clip the same way.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "normal", "lognormal")
# Longer than any model's context: larger numbers are typing mistakes.
MAX_LENGTH = 10_000_000


@dataclass(frozen=True)
class LengthDist:
    # One of KINDS.
    kind: str
    # fixed: the length; uniform: LOW; normal, lognormal: the mean.
    a: float
    # uniform: HIGH; normal: STD; lognormal: SIGMA of the log; fixed: unused (0).
    b: float = 0.0
    # The smallest and largest length returned.
    low: int = 1
    high: int = MAX_LENGTH

    @classmethod
    def parse(cls, spec: str, cap: int | None = None, what: str = "length") -> LengthDist:
        return parse_length(spec, what, cap)

    @property
    def mu(self) -> float:
        """lognormal: the mean of the log, so that the lengths' mean is `a`:
        E[exp(N(mu, s^2))] = exp(mu + s^2 / 2)."""
        # b * b, not b**2: an absurd SIGMA gives inf (refused by the caller), not OverflowError.
        return math.log(self.a) - self.b * self.b / 2

    @property
    def median(self) -> float:
        """The unclipped distribution's median."""
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return math.exp(self.mu) if self.kind == "lognormal" else self.a

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.lognormvariate(self.mu, self.b)
        # Clipped before rounding: a far tail may be too large to round.
        return round(min(max(value, self.low), self.high))


def parse_length(spec: str, what: str = "length", cap: int | None = None) -> LengthDist:
    """A LengthDist from a spec; ValueError naming `what` and the problem.

    cap: the longest length the target takes (a model's prompt limit); a spec
    whose every length is longer is refused (lengths are never clipped to it)."""
    parts = spec.strip().split(":")
    kind = parts[0] if len(parts) > 1 else "fixed"
    if kind not in KINDS:
        raise ValueError(f"{what} {spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    try:
        values = [float(x) for x in (parts[1:] if len(parts) > 1 else parts)]
    except ValueError:
        raise ValueError(f"{what} {spec!r}: numbers expected after the kind") from None
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"{what} {spec!r}: numbers must be finite")
    dist = _dist(kind, values, f"{what} {spec!r}")
    if cap is not None and dist.low > cap:
        raise ValueError(
            f"{what} {spec!r}: every length is over {cap} tokens, the longest the model takes"
        )
    return dist


def _dist(kind: str, values: list[float], where: str) -> LengthDist:
    if kind == "fixed":
        if len(values) != 1 or not _is_length(values[0]):
            raise ValueError(f"{where}: a fixed length is one integer in 1..{MAX_LENGTH:,}")
        n = int(values[0])
        return LengthDist("fixed", n, low=n, high=n)
    if kind == "uniform":
        if len(values) != 2 or not all(map(_is_length, values)) or values[0] > values[1]:
            raise ValueError(
                f"{where}: uniform:LOW:HIGH, integers with 1 <= LOW <= HIGH <= {MAX_LENGTH:,}"
            )
        low, high = int(values[0]), int(values[1])
        return LengthDist("uniform", low, high, low, high)
    if len(values) not in (2, 4):
        raise ValueError(f"{where}: {kind}:MEAN:SPREAD or {kind}:MEAN:SPREAD:MIN:MAX")
    mean, spread = values[:2]
    low, high = (1, MAX_LENGTH) if len(values) == 2 else values[2:]
    if not (_is_length(low) and _is_length(high) and low <= high):
        raise ValueError(
            f"{where}: MIN and MAX are integers with 1 <= MIN <= MAX <= {MAX_LENGTH:,}"
        )
    if spread < 0:
        raise ValueError(
            f"{where}: the spread ({'STD' if kind == 'normal' else 'SIGMA'}) must be >= 0"
        )
    if not low <= mean <= high:
        raise ValueError(f"{where}: the mean must be within [{int(low)}, {int(high):,}]")
    dist = LengthDist(kind, mean, spread, int(low), int(high))
    if not low <= dist.median <= high:
        # A mean-preserving log-normal's median falls as SIGMA grows (lognormal:1000:50
        # would make nearly every length MIN): say so rather than sample it.
        raise ValueError(
            f"{where}: with that spread the median is {dist.median:.3g}, outside "
            f"[{int(low)}, {int(high):,}]: more than half the lengths would be clipped to a "
            "bound; use a smaller spread"
        )
    return dist


def _is_length(value: float) -> bool:
    return value == int(value) and 1 <= value <= MAX_LENGTH
