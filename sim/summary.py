"""Summary: a run's records as latency percentiles, goodput under an SLO and GPU cost.

Goodput here is DistServe's request-level notion: a request is good when it
finished and met both its time-to-first-token and its time-per-output-token
objectives; goodput is good requests per second of the workload, attainment
is their share of all requests (failed and unfinished ones count as missed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from tandem.sim.records import RequestRecord, RunResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    # Seconds from arrival to the first token.
    ttft_s: float = 2.0
    # Mean seconds between output tokens after the first.
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {value!r}")

    def met(self, record: RequestRecord) -> bool:
        if record.finish_s is None:
            return False
        tpot = record.tpot_s
        return record.ttft_s <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


@dataclass(frozen=True)
class Latency:
    """Percentiles of one latency over the finished requests, seconds (NaN if none)."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        if not values:
            return cls(math.nan, math.nan, math.nan, math.nan)
        array = np.asarray(values, dtype=float)
        p50, p90, p99 = np.percentile(array, PERCENTILES).tolist()
        return cls(float(array.mean()), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    requests: int
    finished: int
    failed: int
    # Neither finished nor refused when the run stopped (max_time_s).
    unfinished: int
    # Seconds from the first to the last arrival (the rate's denominator).
    duration_s: float
    slo: SLO
    # Requests that met the SLO, per second of the workload.
    goodput_rps: float
    # Share of all requests that met the SLO.
    attainment: float
    throughput_rps: float
    output_tokens_per_s: float
    ttft: Latency
    tpot: Latency
    e2e: Latency
    gpu_seconds: float
    peak_gpus: int
    scale_events: int
    steps: int
    wall_s: float

    @property
    def goodput_per_gpu_hour(self) -> float:
        """Good requests per GPU-hour: what a GPU bought."""
        good = self.goodput_rps * self.duration_s
        return good / (self.gpu_seconds / 3600) if self.gpu_seconds else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["goodput_per_gpu_hour"] = self.goodput_per_gpu_hour
        return out


def summarize(result: RunResult, slo: SLO) -> Summary:
    records = result.records
    finished = [r for r in records if r.finish_s is not None]
    failed = sum(1 for r in records if r.failure is not None)
    good = sum(1 for r in finished if slo.met(r))
    first = min((r.arrival_s for r in records), default=0.0)
    last = max((r.arrival_s for r in records), default=0.0)
    # A single instant (one request) still spans something: the time it took.
    duration = max(last - first, 1e-9) if len(records) > 1 else max(result.end_s, 1e-9)
    tpots = [t for t in (r.tpot_s for r in finished) if t is not None]
    return Summary(
        requests=len(records),
        finished=len(finished),
        failed=failed,
        unfinished=len(records) - len(finished) - failed,
        duration_s=duration,
        slo=slo,
        goodput_rps=good / duration,
        attainment=good / len(records) if records else 0.0,
        throughput_rps=len(finished) / duration,
        output_tokens_per_s=sum(r.output_tokens for r in finished) / duration,
        ttft=Latency.of([r.ttft_s for r in finished]),
        tpot=Latency.of(tpots),
        e2e=Latency.of([r.e2e_s for r in finished]),
        gpu_seconds=result.gpu_seconds,
        peak_gpus=peak_gpus(result),
        scale_events=len(result.scale_events),
        steps=result.steps,
        wall_s=result.wall_s,
    )


def peak_gpus(result: RunResult) -> int:
    """Most GPUs held at once (pods starting included)."""
    changes = sorted(
        [(p.created_s, p.gpus) for p in result.pods] + [(p.gone_s, -p.gpus) for p in result.pods],
        key=lambda c: (c[0], c[1]),  # at a tie, release before acquire
    )
    held = peak = 0
    for _, delta in changes:
        held += delta
        peak = max(peak, held)
    return peak
