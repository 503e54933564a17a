"""Study 2: the ALL / ANY prefill attempt intervals with data-parallel ranks voting.

One NORMAL pod of Llama-8B with 4 data-parallel ranks (TP 1 each: 4 H200s)
serving chat (~1k in / 300 out). Each rank is a real Scheduler; the ranks'
votes are the real StepVote over an all-reduce MIN (sim/lockstep.py). The
intervals are swept from eager (prefill at nearly every step) to the default
(70 / 100) and past it, and with one kind of point switched off (a huge
interval): TTFT falls with shorter intervals while TPOT rises, since every
prompt step stalls every rank's decode.
"""

from __future__ import annotations

from tandem.sim import deployment as deploy
from tandem.sim.cluster import ClusterConfig, simulate
from tandem.sim.devices import H200
from tandem.sim.model_shapes import model_shape
from tandem.sim.records import RunResult
from tandem.sim.summary import SLO, summarize
from tandem.sim.workload import LengthDist, synthesize

DP = 4
# A point that never comes: the interval only has to be valid.
NEVER = 1_000_000
# (ALL interval, ANY interval)
INTERVALS = (
    (2, 3),
    (10, 15),
    (35, 50),
    (70, 100),
    (140, 200),
    (280, 400),
    (70, NEVER),
    (NEVER, 100),
)
SLO_CHAT = SLO(1.0, 0.03)
# requests/s: a light load (ranks often have nothing waiting at an ALL point)
# and a heavy one (every rank usually has).
RATES = (4.0, 24.0)


def run(all_every: int, any_every: int, rate: float, duration_s: float, seed: int) -> RunResult:
    engine = {
        "data_parallel_size": DP,
        "prefill_attempt_interval": all_every,
        "prefill_any_attempt_interval": any_every,
    }
    deployment = deploy.normal(1, tp=1, engine=engine)
    requests = synthesize(
        rate=rate,
        duration_s=duration_s,
        input_len=LengthDist.parse("lognormal:1000:0.4:1:8000"),
        output_len=LengthDist.parse("lognormal:300:0.4:1:2000"),
        seed=seed,
    )
    return simulate(ClusterConfig(deployment, H200, model_shape("llama-8b")), requests)


def sweep(rate: float, duration_s: float, seed: int, log=print) -> dict[tuple[int, int], RunResult]:
    out = {}
    for all_every, any_every in INTERVALS:
        out[(all_every, any_every)] = result = run(all_every, any_every, rate, duration_s, seed)
        log(f"  intervals {_label(all_every)}/{_label(any_every)}: {result.wall_s:.0f}s wall")
    return out


def _label(interval: int) -> str:
    return "never" if interval >= NEVER else str(interval)


def table(runs: dict[tuple[int, int], RunResult], rate: float) -> str:
    lines = [
        f"| ALL / ANY interval | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | E2E p50 (s) "
        f"| SLO attainment (TTFT {SLO_CHAT.ttft_s:g} s, TPOT {SLO_CHAT.tpot_s * 1e3:g} ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for (a, b), result in runs.items():
        s = summarize(result, SLO_CHAT)
        lines.append(
            f"| {_label(a)} / {_label(b)} | {s.ttft.p50:.2f} / {s.ttft.p99:.2f} "
            f"| {s.tpot.p50 * 1e3:.1f} / {s.tpot.p99 * 1e3:.1f} | {s.e2e.p50:.1f} "
            f"| {s.attainment:.0%} |"
        )
    lines.append(f"\n{rate:g} req/s of chat on one pod of {DP} data-parallel ranks")
    return "\n".join(lines)


def plot(by_rate: dict[float, dict[tuple[int, int], RunResult]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_rate), figsize=(6 * len(by_rate), 4), squeeze=False)
    for ax, (rate, runs) in zip(axes[0], by_rate.items(), strict=True):
        _panel(ax, runs, rate)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax, runs: dict[tuple[int, int], RunResult], rate: float) -> None:
    for (a, b), result in runs.items():
        s = summarize(result, SLO_CHAT)
        ax.scatter(s.tpot.p50 * 1e3, s.ttft.p50, color="C0")
        ax.scatter(s.tpot.p99 * 1e3, s.ttft.p99, color="C3", marker="x")
        ax.annotate(f"{_label(a)}/{_label(b)}", (s.tpot.p50 * 1e3, s.ttft.p50), fontsize=7)
    ax.scatter([], [], color="C0", label="p50")
    ax.scatter([], [], color="C3", marker="x", label="p99")
    ax.set_xlabel("TPOT (ms)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("log")
    ax.set_title(f"ALL/ANY intervals, {DP} DP ranks voting, {rate:g} req/s", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
