"""Summary: a run's records as latency percentiles, goodput under an SLO and GPU cost.

Goodput here is DistServe's request-level notion: a request is good when it
finished and met both its time-to-first-token and its time-per-output-token
objectives; goodput is good requests per second of the run's span, attainment
is their share of all requests (failed and unfinished ones count as missed).

Every rate divides by the run's span: from its start (t = 0, which arrival
times count from) to the last answer (a last token or a refusal), or to where
the run stopped if requests were left unanswered. From 0 rather than from the
first arrival, because the first gap is part of the offered load: a Poisson
workload's throughput is then not biased above its rate on short runs
(`tandem bench` counts from its first send, which reads a little high there).
Tokens are those generated: a request whose context reached max_model_len
counts what it made, not what it asked for.
"""

from __future__ import annotations

import math
from collections import Counter
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
        for flag, value in (("--slo-ttft", self.ttft_s), ("--slo-tpot", self.tpot_s)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{flag} must be a finite number of seconds > 0, got {value!r}")

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
    # Why requests were refused: {reason: requests}.
    failures: dict[str, int]
    # Neither finished nor refused when the run stopped (max_time_s).
    unfinished: int
    # Finished short of their output length: the context reached max_model_len.
    truncated: int
    # The run's span (the module's docstring): every rate's denominator.
    duration_s: float
    slo: SLO
    # Requests that met the SLO, per second of the run's span.
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
    # Requests the run stopped (--max-time) before they arrived were never sent: counted
    # as unfinished, they halved the attainment of a run stopped halfway.
    records = [r for r in result.records if r.arrival_s <= result.end_s]
    finished = [r for r in records if r.finish_s is not None]
    failures = Counter(r.failure for r in records if r.failure is not None)
    failed = sum(failures.values())
    unfinished = len(records) - len(finished) - failed
    good = sum(1 for r in finished if slo.met(r))
    duration = span_s(records, result.end_s if unfinished else None)
    tpots = [t for t in (r.tpot_s for r in finished) if t is not None]
    return Summary(
        requests=len(records),
        finished=len(finished),
        failed=failed,
        failures=dict(failures.most_common()),
        unfinished=unfinished,
        truncated=sum(1 for r in finished if r.truncated),
        duration_s=duration,
        slo=slo,
        goodput_rps=_rate(good, duration),
        attainment=good / len(records) if records else 0.0,
        throughput_rps=_rate(len(finished), duration),
        output_tokens_per_s=_rate(sum(r.generated_tokens for r in finished), duration),
        ttft=Latency.of([r.ttft_s for r in finished]),
        tpot=Latency.of(tpots),
        e2e=Latency.of([r.e2e_s for r in finished]),
        gpu_seconds=result.gpu_seconds,
        peak_gpus=peak_gpus(result),
        scale_events=len(result.scale_events),
        steps=result.steps,
        wall_s=result.wall_s,
    )


def span_s(records: Sequence[RequestRecord], stopped_s: float | None = None) -> float:
    """The run's span that rates divide by: from 0 to the last answer (a last token
    or a refusal), or to `stopped_s` when the run stopped with requests unanswered."""
    if stopped_s is not None:
        return stopped_s
    ends = [r.finish_s if r.failed_s is None else r.failed_s for r in records]
    return max((e for e in ends if e is not None), default=0.0)


def _rate(count: float, seconds: float) -> float:
    # A span of no time answered nothing (refusals at t = 0 at most).
    return count / seconds if seconds > 0 else 0.0


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
