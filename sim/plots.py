"""Plots of one run (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.sim.records import RunResult
from tandem.sim.summary import SLO


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_plots(
    result: RunResult, slo: SLO, directory: str | Path, prefix: str = "sim"
) -> list[Path]:
    """Replica timeline per role, and TTFT / TPOT distributions; returns the files."""
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for role in sorted({p.role for p in result.timeline}):
        points = [p for p in result.timeline if p.role == role]
        t = [p.time_s / 3600 for p in points]
        ax.step(t, [p.desired for p in points], where="post", label=f"{role} desired")
        ax.step(t, [p.ready for p in points], where="post", ls="--", label=f"{role} ready")
    ax.set_xlabel("hours")
    ax.set_ylabel("pods")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(_save(fig, directory / f"{prefix}-replicas.png"))

    finished = [r for r in result.records if r.finish_s is not None]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, name, values, limit in (
        (axes[0], "TTFT", [r.ttft_s for r in finished], slo.ttft_s),
        (axes[1], "TPOT", [r.tpot_s for r in finished if r.tpot_s is not None], slo.tpot_s),
    ):
        if values:
            x = np.sort(np.asarray(values) * 1e3)
            ax.plot(x, np.linspace(0, 1, len(x)))
        ax.axvline(limit * 1e3, color="red", ls=":", label="SLO")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths.append(_save(fig, directory / f"{prefix}-latency.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
