"""Study 1: Normal against Disaggregated for a 70B model on H200s (docs/simulator.md).

16 H200s as four engines of TP 4 (a 70B model's bf16 weights, 141 GB, leave
no KV room at TP 1 or 2 on 141 GB devices; TP 4 is the smallest power of two
with a large cache). Normal: four NORMAL engines. Disaggregated: every split
of the four engines into prefill and decode; and Normal with eager attempt
points (10 / 15 instead of 70 / 100). Two workloads: long-prompt RAG
(~4k in / 250 out) and chat (~1k in / 300 out), Poisson arrivals. For each
configuration the arrival rate is swept; goodput is DistServe's: the highest
rate at which at least 90 % of requests meet both TTFT and TPOT objectives,
here per GPU. Objectives are applied after the runs, so one sweep serves
every SLO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.sim import deployment as deploy
from tandem.sim.cluster import ClusterConfig, simulate
from tandem.sim.devices import H200
from tandem.sim.model_shapes import model_shape
from tandem.sim.records import RunResult
from tandem.sim.summary import SLO
from tandem.sim.workload import LengthDist, synthesize

TP = 4
ENGINES = 4
ATTAINMENT = 0.9


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: str
    output_len: str
    rates: tuple[float, ...]
    # (label, SLO): tight objectives first.
    slos: tuple[tuple[str, SLO], ...]


WORKLOADS = (
    Workload(
        "rag",
        "lognormal:4000:0.25:1:8000",
        "lognormal:250:0.3:1:2000",
        (2, 4, 6, 8, 10, 12, 14, 16),
        (("tight", SLO(1.5, 0.04)), ("loose", SLO(5.0, 0.1))),
    ),
    Workload(
        "chat",
        "lognormal:1000:0.4:1:8000",
        "lognormal:300:0.4:1:2000",
        (10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60),
        (("tight", SLO(1.0, 0.03)), ("loose", SLO(3.0, 0.1))),
    ),
)


def configurations() -> dict[str, deploy.Deployment]:
    configs = {f"normal {ENGINES}": deploy.normal(ENGINES, tp=TP)}
    # The same engines with eager attempt points: separates the wait for an
    # attempt point from prefill-decode interference (study 2 sweeps them).
    eager = {"prefill_attempt_interval": 10, "prefill_any_attempt_interval": 15}
    configs[f"normal {ENGINES}, intervals 10/15"] = deploy.normal(ENGINES, tp=TP, engine=eager)
    for prefill in range(1, ENGINES):
        decode = ENGINES - prefill
        configs[f"disagg {prefill}P{decode}D"] = deploy.disaggregated(prefill, decode, tp=TP)
    return configs


def sweep(
    workload: Workload, duration_s: float, seed: int, log=print
) -> dict[str, dict[float, RunResult]]:
    """Every configuration at every rate: {config: {rate: result}}."""
    shape = model_shape("llama-70b")
    out: dict[str, dict[float, RunResult]] = {}
    for name, deployment in configurations().items():
        out[name] = {}
        for rate in workload.rates:
            requests = synthesize(
                rate=rate,
                duration_s=duration_s,
                input_len=LengthDist.parse(workload.input_len),
                output_len=LengthDist.parse(workload.output_len),
                seed=seed,
            )
            result = simulate(ClusterConfig(deployment, H200, shape), requests)
            out[name][rate] = result
            log(f"  {workload.name} {name} {rate:g}/s: {result.wall_s:.0f}s wall")
    return out


def attainment(result: RunResult, slo: SLO) -> float:
    return sum(slo.met(r) for r in result.records) / len(result.records)


def goodput(runs: dict[float, RunResult], slo: SLO) -> float:
    """The highest swept rate with attainment >= 90 % (0 if none)."""
    ok = [rate for rate, result in sorted(runs.items()) if attainment(result, slo) >= ATTAINMENT]
    return max(ok, default=0.0)


def table(workload: Workload, runs: dict[str, dict[float, RunResult]]) -> str:
    gpus = ENGINES * TP
    head = " | ".join(
        f"{label} SLO (TTFT {s.ttft_s:g} s, TPOT {s.tpot_s * 1e3:g} ms)"
        for label, s in workload.slos
    )
    lines = [
        f"| {workload.name}: config | {head} | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) |",
        "| --- | " + " | ".join("---:" for _ in workload.slos) + " | ---: | ---: |",
    ]
    for name, by_rate in runs.items():
        cells = []
        for _, slo in workload.slos:
            rate = goodput(by_rate, slo)
            cells.append(f"{rate:g} req/s ({rate / gpus:.2f}/GPU)")
        mid = by_rate[sorted(by_rate)[len(by_rate) // 2]]
        ttft, tpot = _latency(mid)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ttft} | {tpot} |")
    mid_rate = sorted(next(iter(runs.values())))[len(workload.rates) // 2]
    lines.append(
        f"\nlatency columns at {mid_rate:g} req/s; goodput: highest rate with >= 90 % "
        f"of requests meeting both objectives, {gpus} GPUs"
    )
    return "\n".join(lines)


def _latency(result: RunResult) -> tuple[str, str]:
    import numpy as np

    done = [r for r in result.records if r.finished]
    ttft = np.percentile([r.ttft_s for r in done], [50, 99])
    tpot = np.percentile([r.tpot_s for r in done if r.tpot_s is not None], [50, 99]) * 1e3
    return f"{ttft[0]:.2f} / {ttft[1]:.2f}", f"{tpot[0]:.0f} / {tpot[1]:.0f}"


def plot(results: Sequence[tuple[Workload, dict[str, dict[float, RunResult]]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(10, 3.4 * len(results)), squeeze=False)
    for row, (workload, runs) in enumerate(results):
        for col, (label, slo) in enumerate(workload.slos):
            ax = axes[row][col]
            for name, by_rate in runs.items():
                rates = sorted(by_rate)
                ax.plot(rates, [attainment(by_rate[r], slo) for r in rates], marker="o", label=name)
            ax.axhline(ATTAINMENT, color="grey", ls=":")
            ax.set_title(
                f"{workload.name}, {label}: TTFT <= {slo.ttft_s:g} s, TPOT <= "
                f"{slo.tpot_s * 1e3:g} ms",
                fontsize=9,
            )
            ax.set_xlabel("requests/s (16 H200s)")
            ax.set_ylabel("SLO attainment")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
