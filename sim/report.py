"""Report: a run's summary as text for people and as a JSON document for tools."""

from __future__ import annotations

import math
from typing import Any

from tandem.sim.records import RunResult
from tandem.sim.summary import Latency, Summary


def text(summary: Summary, result: RunResult, title: str = "") -> str:
    s = summary
    lines = [title] if title else []
    lines.append(
        f"requests    {s.requests} in {_seconds(s.duration_s)} s: {s.finished} finished, "
        f"{s.failed} failed, {s.unfinished} unfinished"
    )
    lines += [f"  failed    {count}: {reason}" for reason, count in s.failures.items()]
    if s.truncated:
        lines.append(
            f"  cut short {s.truncated}: their context reached max_model_len before their "
            "output length"
        )
    lines += [
        f"SLO         TTFT <= {s.slo.ttft_s * 1e3:g} ms and TPOT <= {s.slo.tpot_s * 1e3:g} ms: "
        f"attainment {s.attainment:.1%}, goodput {s.goodput_rps:.2f} req/s "
        f"({s.goodput_per_gpu_hour:,.0f} good requests per GPU-hour)",
        f"throughput  {s.throughput_rps:.2f} req/s, {s.output_tokens_per_s:,.0f} output tokens/s",
        "latency     mean / p50 / p90 / p99 (ms)",
        f"  TTFT      {_ms(s.ttft)}",
        f"  TPOT      {_ms(s.tpot)}",
        f"  E2E       {_ms(s.e2e)}",
        f"GPUs        {s.gpu_seconds / 3600:,.1f} GPU-hours, peak {s.peak_gpus} GPUs",
        f"scaling     {s.scale_events} scale events",
    ]
    for event in result.scale_events[:20]:
        lines.append(
            f"  {event.time_s:9.0f} s  {event.role} {event.from_replicas} -> {event.to_replicas}"
        )
    if len(result.scale_events) > 20:
        lines.append(f"  ... and {len(result.scale_events) - 20} more (--json has them all)")
    rate = result.steps / result.wall_s if result.wall_s else math.inf
    lines.append(
        f"simulator   {result.steps:,} engine steps in {result.wall_s:.1f} s wall ({rate:,.0f} "
        f"steps/s), {result.end_s:,.0f} s simulated"
    )
    return "\n".join(lines)


def _seconds(value: float) -> str:
    """A window in seconds: whole ones, unless it is short."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _ms(latency: Latency) -> str:
    values = (latency.mean, latency.p50, latency.p90, latency.p99)
    return " / ".join("-" if math.isnan(v) else f"{v * 1e3:,.0f}" for v in values)


def document(summary: Summary, result: RunResult, setup: dict[str, Any]) -> dict[str, Any]:
    """Everything as plain JSON types: the setup, the summary, scale events, the timeline."""
    return {
        "setup": setup,
        "summary": _finite(summary.to_dict()),
        "scale_events": [
            {
                "time_s": e.time_s,
                "role": e.role,
                "from": e.from_replicas,
                "to": e.to_replicas,
                "reason": e.reason,
            }
            for e in result.scale_events
        ],
        "timeline": [
            {
                "time_s": p.time_s,
                "role": p.role,
                "desired": p.desired,
                "ready": p.ready,
                "starting": p.starting,
                "draining": p.draining,
            }
            for p in result.timeline
        ],
        "simulator": {"steps": result.steps, "wall_s": result.wall_s, "end_s": result.end_s},
    }


def _finite(value: Any) -> Any:
    """NaN and infinities are not JSON: percentiles of nothing become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value
