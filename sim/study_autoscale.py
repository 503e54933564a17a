"""Study 3: the real autoscaler over a bursty day, against fixed peak provisioning.

A day-long trace (workload.day_trace: diurnal, trough at midnight, peak at
noon, random bursts of 2-4x lasting 5-20 minutes; seeded) of long-prompt
requests to Llama-70B on H200s (TP 4 per pod), Normal mode. The autoscaled
deployment has 1 to MAX_PODS pods and the CRD's default policy (queued tokens
8192 per replica, KV 0.7, 300 s scale-down window, steps of 4 / 100 %), once
per scale-up stabilisation window asked for (the CRD's default, 0 s, first);
a pod takes STARTUP_S to become ready. Fixed provisioning runs as many pods as
any autoscaled run ever asked for, all day. The plot shows the first run.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.sim import deployment as deploy
from tandem.sim.cluster import ClusterConfig, simulate
from tandem.sim.devices import H200
from tandem.sim.model_shapes import model_shape
from tandem.sim.records import RunResult
from tandem.sim.summary import SLO, summarize
from tandem.sim.workload import LengthDist, day_trace
from tandem.trace import TraceRequest

TP = 4
MAX_PODS = 8
STARTUP_S = 120.0
SLO_DAY = SLO(3.0, 0.1)
DAY_S = 86_400.0


def trace(mean_rate: float, seed: int, duration_s: float = DAY_S) -> list[TraceRequest]:
    # MAX 8000: 5 % of these prompts would be over the engines' 8191-token limit.
    return day_trace(
        mean_rate=mean_rate,
        input_len=LengthDist.parse("lognormal:4000:0.5:1:8000"),
        output_len=LengthDist.parse("lognormal:100:0.5:1:1000"),
        duration_s=duration_s,
        # day_trace prorates them to duration_s (12 x d/day); prorated here too, a
        # 12-hour run drew 3 bursts, an hour's none.
        bursts_per_day=12,
        seed=seed,
    )


def run_study(
    requests: list[TraceRequest],
    until_s: float,
    up_windows: Sequence[float] = (0.0,),
    log=print,
) -> dict[str, RunResult]:
    """The autoscaled deployment once per scale-up stabilisation window, then fixed
    provisioning at the highest count any of them asked for."""
    shape = model_shape("llama-70b")
    runs: dict[str, RunResult] = {}
    for window in up_windows:
        role = deploy.role_setup(
            "normal",
            replicas=1,
            min_replicas=1,
            max_replicas=MAX_PODS,
            tp=TP,
            policy={"scale_up_stabilization_seconds": float(window)},
        )
        auto = simulate(
            ClusterConfig(
                deploy.Deployment({role.role: role}),
                H200,
                shape,
                startup_s=STARTUP_S,
                until_s=until_s,
            ),
            requests,
        )
        name = f"autoscaled (1-{MAX_PODS} pods)"
        if window:
            name += f", scale-up window {window:g} s"
        log(f"  {name}: {auto.wall_s:.0f}s wall, {len(auto.scale_events)} scale events")
        runs[name] = auto
    peak = max(p.desired for run in runs.values() for p in run.timeline)
    fixed = simulate(
        ClusterConfig(deploy.normal(peak, tp=TP), H200, shape, until_s=until_s), requests
    )
    log(f"  fixed {peak} pods: {fixed.wall_s:.0f}s wall")
    runs[f"fixed {peak} pods (the peak)"] = fixed
    return runs


def table(runs: dict[str, RunResult]) -> str:
    lines = [
        f"| deployment | goodput (req/s) | SLO attainment (TTFT {SLO_DAY.ttft_s:g} s, TPOT "
        f"{SLO_DAY.tpot_s * 1e3:g} ms) | TTFT p50 / p99 (s) | TPOT p99 (ms) | GPU-hours "
        "| good requests per GPU-hour | scale events |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, result in runs.items():
        s = summarize(result, SLO_DAY)
        lines.append(
            f"| {name} | {s.goodput_rps:.3f} | {s.attainment:.1%} | {s.ttft.p50:.2f} / "
            f"{s.ttft.p99:.2f} | {s.tpot.p99 * 1e3:.0f} | {s.gpu_seconds / 3600:,.0f} "
            f"| {s.goodput_per_gpu_hour:,.0f} | {s.scale_events} |"
        )
    return "\n".join(lines)


def plot(requests: list[TraceRequest], runs: dict[str, RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    auto = next(iter(runs.values()))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    arrivals = np.array([r.arrival_s for r in requests])
    bins = np.arange(0, max(arrivals.max(), 1.0) + 300, 300)
    counts, edges = np.histogram(arrivals, bins)
    top.step(edges[:-1] / 3600, counts / 300, where="post", lw=0.8)
    top.set_ylabel("arrivals/s (5 min)")
    top.grid(alpha=0.3)
    points = auto.timeline
    t = [p.time_s / 3600 for p in points]
    bottom.step(t, [p.desired for p in points], where="post", label="desired pods")
    bottom.step(t, [p.ready for p in points], where="post", ls="--", label="ready pods")
    late = _late_share(auto, bins)
    twin = bottom.twinx()
    twin.plot(edges[:-1] / 3600, late, color="C3", lw=0.7, alpha=0.7, label="SLO missed")
    twin.set_ylabel("share missing the SLO", color="C3")
    twin.set_ylim(0, 1)
    bottom.set_xlabel("hour of the day")
    bottom.set_ylabel("pods (TP 4 each)")
    bottom.grid(alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _late_share(result: RunResult, bins) -> list[float]:
    import numpy as np

    arrivals = np.array([r.arrival_s for r in result.records])
    missed = np.array([not SLO_DAY.met(r) for r in result.records], dtype=float)
    total, _ = np.histogram(arrivals, bins)
    late, _ = np.histogram(arrivals, bins, weights=missed)
    return (late / np.maximum(total, 1)).tolist()


def summary_line(runs: dict[str, RunResult]) -> str:
    """Each run's attainment and GPU-hours, then each autoscaled run's ratios against the
    baseline, the fixed run (the last)."""
    summaries = {name: summarize(result, SLO_DAY) for name, result in runs.items()}
    parts = [
        f"{name}: attainment {s.attainment:.1%} on {s.gpu_seconds / 3600:,.0f} GPU-hours"
        for name, s in summaries.items()
    ]
    *autoscaled, (baseline_name, baseline) = summaries.items()
    ratios = [
        f"{name} against {baseline_name}: {baseline.gpu_seconds / s.gpu_seconds:.1f}x fewer "
        f"GPU-hours, {s.goodput_per_gpu_hour / baseline.goodput_per_gpu_hour:.1f}x the good "
        "requests per GPU-hour"
        for name, s in autoscaled
        if s.gpu_seconds > 0 and baseline.goodput_per_gpu_hour > 0
    ]
    return "\n".join(["; ".join(parts), *ratios])
