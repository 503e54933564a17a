"""Token-length distributions for prompts and outputs, from a short spec string.

Specs (all bounds inclusive, every length at least 1):
  `128`                         fixed
  `uniform:LOW:HIGH`            uniform integers
  `normal:MEAN:STD[:MIN:MAX]`   rounded normal, clipped to [MIN, MAX] (default [1, inf))
  `lognormal:MEDIAN:SIGMA[:MIN:MAX]`  rounded log-normal (SIGMA of the log), clipped
Clipping rather than resampling keeps the sampler's cost fixed and its
output reproducible; the bounds are there to cap the tail, not to reshape it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

KINDS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    # One of KINDS.
    kind: str
    # fixed: the length; uniform: LOW; normal: MEAN; lognormal: MEDIAN.
    a: float
    # uniform: HIGH; normal: STD; lognormal: SIGMA; fixed: unused (0).
    b: float = 0.0
    # Smallest length returned.
    low: int = 1
    # Largest length returned; None: no cap.
    high: int | None = None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.lognormvariate(math.log(self.a), self.b)
        value = max(self.low, round(value))
        return value if self.high is None else min(self.high, value)


def parse_length(spec: str, what: str = "length") -> LengthDist:
    """A LengthDist from a spec; ValueError naming `what` and the problem."""
    parts = spec.strip().split(":")
    kind = parts[0] if len(parts) > 1 else "fixed"
    numbers = parts[1:] if len(parts) > 1 else parts
    try:
        values = [float(x) for x in numbers]
    except ValueError:
        raise ValueError(f"{what} {spec!r}: numbers expected after the kind") from None
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"{what} {spec!r}: numbers must be finite")
    if kind == "fixed":
        if len(values) != 1 or values[0] < 1 or values[0] != int(values[0]):
            raise ValueError(f"{what} {spec!r}: a fixed length is one integer >= 1")
        return LengthDist("fixed", values[0], low=int(values[0]), high=int(values[0]))
    if kind == "uniform":
        if len(values) != 2 or not 1 <= values[0] <= values[1]:
            raise ValueError(f"{what} {spec!r}: uniform:LOW:HIGH with 1 <= LOW <= HIGH")
        return LengthDist("uniform", int(values[0]), int(values[1]), int(values[0]), int(values[1]))
    if kind in ("normal", "lognormal"):
        if len(values) not in (2, 4):
            raise ValueError(f"{what} {spec!r}: {kind}:A:B or {kind}:A:B:MIN:MAX")
        a, b = values[:2]
        if b < 0 or (kind == "lognormal" and a <= 0):
            raise ValueError(f"{what} {spec!r}: the spread must be >= 0 (and a median > 0)")
        low, high = (1, None) if len(values) == 2 else (int(values[2]), int(values[3]))
        if low < 1 or (high is not None and high < low):
            raise ValueError(f"{what} {spec!r}: bounds must satisfy 1 <= MIN <= MAX")
        return LengthDist(kind, a, b, low, high)
    raise ValueError(f"{what} {spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
