"""The report: throughput, latency percentiles, goodput and errors, from the run's records.

Definitions (docs/bench-client.md says the same for users):
- rates divide by the wall time from the first send to the last successful answer;
- TTFT: send to the first chunk with text; E2E: send to the end of the
  answer; TPOT: (E2E - TTFT) / (output tokens - 1), per request, for
  successful requests with at least two output tokens; ITL: the gaps
  between consecutive text chunks (a chunk may carry several tokens);
- latencies are over successful requests only (a 429 answered in 1 ms would
  otherwise flatter every percentile); errors are counted apart;
- goodput: successful requests per second whose TTFT and TPOT met the
  given SLOs (an SLO not given is not checked; a request with one output
  token has no TPOT and meets any TPOT SLO).
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from tandem.loadgen.record import RequestRecord
from tandem.loadgen.runner import RunResult

SCHEMA = "tandem.bench.report/v1"
# A send this much after its arrival waited for a --concurrency slot (not the loop's
# own jitter, a millisecond or two).
LATE_S = 0.05
PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Slo:
    # Largest acceptable time to first token, ms; None: not checked.
    ttft_ms: float | None = None
    # Largest acceptable time per output token, ms; None: not checked.
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("--slo-ttft-ms", self.ttft_ms), ("--slo-tpot-ms", self.tpot_ms)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        # An answer with no token (an end of sequence first) has no TTFT: it meets no
        # TTFT objective, and without one it is a success like any other.
        ttft = record.ttft_s
        if self.ttft_ms is not None and (ttft is None or ttft * 1000 > self.ttft_ms):
            return False
        tpot = record.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


@dataclass(frozen=True)
class Summary:
    # Number of values summarised.
    count: int
    # Arithmetic mean.
    mean: float
    # Percentiles, linear interpolation.
    p50: float
    p90: float
    p95: float
    p99: float
    # Extremes.
    min: float
    max: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; ValueError when empty."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float], scale: float = 1.0) -> Summary | None:
    """Mean, percentiles and extremes of values x scale; None when there are none."""
    if not values:
        return None
    scaled = [v * scale for v in values]
    p50, p90, p95, p99 = (percentile(scaled, q) for q in PERCENTILES)
    mean = sum(scaled) / len(scaled)
    return Summary(len(scaled), mean, p50, p90, p95, p99, min(scaled), max(scaled))


def error_counts(records: list[RequestRecord]) -> dict[str, dict[str, Any]]:
    """By kind: how many, and the first message seen as an example."""
    errors: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.error_kind is None:
            continue
        entry = errors.setdefault(r.error_kind, {"count": 0, "example": r.error_message})
        entry["count"] += 1
    return dict(sorted(errors.items()))


def build_report(result: RunResult, slo: Slo, config: dict[str, Any]) -> dict[str, Any]:
    """The report as JSON-ready data (schema SCHEMA, checked in tests)."""
    records = result.records
    ok = [r for r in records if r.ok]
    wall = result.wall_s
    per_s = (lambda x: x / wall) if wall > 0 else (lambda x: 0.0)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    input_tokens = sum(r.input_tokens if r.prompt_tokens is None else r.prompt_tokens for r in ok)
    good = sum(slo.met_by(r) for r in records)
    # Sent and cut by a Ctrl-C: neither ok nor failed, but sent (they were the slow ones).
    cut = result.interrupted or 0
    # How long each send waited past its arrival (for a --concurrency slot, or for the
    # client): none to speak of in a closed loop, where all arrive at 0.
    waits = [0.0 if result.closed_loop else max(0.0, r.start_s - r.scheduled_s) for r in records]
    by_status = Counter("none" if r.status is None else str(r.status) for r in records)
    latency = {
        "ttft": summarize([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
        "tpot": summarize([r.tpot_s for r in ok if r.tpot_s is not None], 1000),
        "itl": summarize([g for r in ok for g in r.chunk_gaps_s], 1000),
        "e2e": summarize([r.e2e_s for r in ok if r.e2e_s is not None], 1000),
    }
    return {
        "schema": SCHEMA,
        "started_at": result.started_at,
        "config": config,
        "wall_s": wall,
        "requests": {
            "sent": len(records) + cut,
            "ok": len(ok),
            "failed": len(records) - len(ok),
            "by_status": dict(sorted(by_status.items())),
            "errors": error_counts(records),
            # Outputs counted from chunks (the server sent no usage): approximate.
            "usage_missing": sum(1 for r in ok if not r.usage_reported),
            # Outputs that ended before max_tokens (EOS honoured, or a stop): by the
            # finish reason, as a server without usage leaves only chunks to count.
            "short_outputs": sum(1 for r in ok if r.finish_reason != "length"),
            "interrupted": result.interrupted,
            # The offered load, where it was not met: sends that waited for a slot
            # (their latencies count from the send), and arrivals never sent.
            "late": sum(1 for w in waits if w > LATE_S),
            "slot_wait_max_s": max(waits, default=0.0),
            "left_unsent": result.left_unsent and not result.closed_loop,
        },
        "throughput": {
            "requests_per_s": per_s(len(ok)),
            "output_tokens_per_s": per_s(output_tokens),
            "input_tokens_per_s": per_s(input_tokens),
            "output_tokens": output_tokens,
            "input_tokens": input_tokens,
        },
        "latency_ms": {name: None if s is None else asdict(s) for name, s in latency.items()},
        "goodput": {
            "slo_ttft_ms": slo.ttft_ms,
            "slo_tpot_ms": slo.tpot_ms,
            "good": good,
            "fraction": good / (len(records) + cut) if records or cut else 0.0,
            "requests_per_s": per_s(good),
        },
        "replicas": [{"t_s": s.t_s, "roles": s.roles} for s in result.replicas],
        "replicas_error": result.replicas_error,
        "records": [r.to_json() for r in records],
    }


def format_report(report: dict[str, Any]) -> str:
    """The report for people: a few aligned lines."""
    req, thr, good = report["requests"], report["throughput"], report["goodput"]
    statuses = ", ".join(f"{k}: {v}" for k, v in req["by_status"].items())
    lines = [
        f"requests     {req['sent']} sent, {req['ok']} ok, {req['failed']} failed "
        f"in {report['wall_s']:.2f} s   (HTTP status {statuses})",
        f"throughput   {thr['requests_per_s']:.2f} req/s   "
        f"{thr['output_tokens_per_s']:.1f} output tok/s   "
        f"{thr['input_tokens_per_s']:.1f} input tok/s",
        "",
        f"{'latency ms':<12} {'mean':>9} {'p50':>9} {'p90':>9} {'p95':>9} {'p99':>9} {'n':>6}",
    ]
    for name, s in report["latency_ms"].items():
        if s is None:
            lines.append(f"{name.upper():<12} {'-':>9}")
            continue
        cells = " ".join(f"{s[k]:>9.1f}" for k in ("mean", "p50", "p90", "p95", "p99"))
        lines.append(f"{name.upper():<12} {cells} {s['count']:>6}")
    slos = []
    if good["slo_ttft_ms"] is not None:
        slos.append(f"TTFT <= {good['slo_ttft_ms']:g} ms")
    if good["slo_tpot_ms"] is not None:
        slos.append(f"TPOT <= {good['slo_tpot_ms']:g} ms")
    met = f"met {' and '.join(slos)}" if slos else "ok; no SLO given, every success counts"
    lines += [
        "",
        f"goodput      {good['requests_per_s']:.2f} req/s ({good['good']}/{req['sent']} {met})",
    ]
    for kind, entry in req["errors"].items():
        lines.append(f"error        {kind} x{entry['count']}: {entry['example']}")
    if req["usage_missing"]:
        lines.append(f"note         {req['usage_missing']} answers had no usage: outputs counted")
    if req["short_outputs"]:
        lines.append(f"note         {req['short_outputs']} outputs ended before max_tokens")
    if req["interrupted"] is not None:
        lines.append(
            f"note         interrupted (Ctrl-C or SIGTERM): the {req['interrupted']} requests "
            "in flight were cut (counted sent, not ok), the latencies cover the rest"
        )
    if req["late"] or req["left_unsent"]:
        unsent = "; arrivals within --duration were left unsent" if req["left_unsent"] else ""
        # Without a cap, a late send is the client's own: it could not keep up.
        waited = (
            "for a free --concurrency slot"
            if report["config"].get("concurrency")
            else ("on this client, which could not keep up")
        )
        lines.append(
            f"note         offered load not met: {req['late']} sends waited {waited} "
            f"(up to {req['slot_wait_max_s']:.2f} s; latencies count from the send){unsent}"
        )
    if report["replicas"]:
        roles = sorted({role for s in report["replicas"] for role in s["roles"]})
        spans = []
        for role in roles:
            counts = [s["roles"].get(role, 0) for s in report["replicas"]]
            spans.append(f"{role} {min(counts)}..{max(counts)}")
        lines.append(f"replicas     {', '.join(spans) or 'none live'}")
    if report["replicas_error"] and not report["replicas"]:
        lines.append(f"replicas     unavailable: {report['replicas_error']}")
    return "\n".join(lines)
