"""PNG plots of a run for people: latency CDFs, throughput over time, replicas over time.

matplotlib (Agg backend: no display needed) is imported only here and only
when plots are asked for: it takes about a second to import.
"""

from __future__ import annotations

import math
from pathlib import Path

from tandem.loadgen.record import RequestRecord
from tandem.loadgen.replicas import ReplicaSample
from tandem.loadgen.runner import RunResult


def cdf_points(values: list[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of values at or below each."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def throughput_series(
    records: list[RequestRecord], bucket_s: float
) -> tuple[list[float], list[float], list[float]]:
    """Bucket starts, finished requests/s and output tokens/s per bucket of `bucket_s`.

    Tokens are placed at the chunks that carried them: a request's output
    count is spread evenly over its text chunks (a chunk may hold several).
    """
    if not bucket_s > 0:
        raise ValueError(f"bucket must be > 0 s, got {bucket_s}")
    ends = [r.end_s for r in records if r.ok and r.end_s is not None]
    if not ends:
        return [], [], []
    buckets = math.floor(max(ends) / bucket_s) + 1
    done = [0.0] * buckets
    tokens = [0.0] * buckets
    for r in records:
        if not r.ok or r.end_s is None:
            continue
        done[math.floor(r.end_s / bucket_s)] += 1 / bucket_s
        if r.chunk_times_s and r.output_tokens:
            share = r.output_tokens / len(r.chunk_times_s) / bucket_s
            for t in r.chunk_times_s:
                tokens[min(buckets - 1, math.floor(t / bucket_s))] += share
    return [i * bucket_s for i in range(buckets)], done, tokens


def write_plots(result: RunResult, directory: Path, title: str = "") -> list[Path]:
    """Write the PNGs into `directory` (created); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in result.records if r.ok]
    written = []

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    series = {
        "TTFT": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "TPOT": [r.tpot_s * 1000 for r in ok if r.tpot_s is not None],
        "E2E": [r.e2e_s * 1000 for r in ok if r.e2e_s is not None],
    }
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs, ys = cdf_points(values)
            ax.step(xs, ys, where="post")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Latency CDFs {title}".strip())
    fig.tight_layout()
    written.append(_save(fig, directory / "latency_cdfs.png", plt))

    bucket = max(0.5, result.wall_s / 60) if result.wall_s else 1.0
    starts, done, tokens = throughput_series(result.records, bucket)
    if starts:  # close the last bucket: a post-step draws nothing after the last point
        starts, done, tokens = (
            [*starts, starts[-1] + bucket],
            [*done, done[-1]],
            [*tokens, tokens[-1]],
        )
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.step(starts, tokens, where="post", label="output tokens/s", color="tab:blue")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    twin = ax.twinx()
    twin.step(starts, done, where="post", label="requests/s", color="tab:orange")
    twin.set_ylabel("finished requests/s", color="tab:orange")
    ax.set_title(f"Throughput over time ({bucket:g} s buckets) {title}".strip())
    ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(_save(fig, directory / "throughput.png", plt))

    if result.replicas:
        written.append(_replicas_plot(result.replicas, directory / "replicas.png", title, plt))
    return written


def _replicas_plot(samples: list[ReplicaSample], path: Path, title: str, plt) -> Path:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    roles = sorted({role for s in samples for role in s.roles})
    times = [s.t_s for s in samples]
    for role in roles:
        ax.step(times, [s.roles.get(role, 0) for s in samples], where="post", label=role)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("live engines")
    peak = max((n for s in samples for n in s.roles.values()), default=0)
    ax.set_ylim(0, peak + 1)
    ax.set_yticks(range(peak + 2))
    ax.set_title(f"Replicas per role {title}".strip())
    if roles:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
