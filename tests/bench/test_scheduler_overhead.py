"""bench/scheduler_overhead.py end to end, few steps: its figures in docs/benchmarks.md
come from it, so it must keep running (a scheduler rule once made it stop before its
table)."""

from __future__ import annotations

import re

from tests.bench.conftest import NUMBER, run_bench

CASES = (
    "decode, 256 seqs, no drafts",
    "decode, 256 seqs, 5 drafts",
    "prompt step, 64 new + 128 running",
)


def test_the_scheduler_bench_prints_every_case_against_its_target() -> None:
    run = run_bench("scheduler_overhead.py", "--steps", "20")
    assert run.returncode == 0, run.stderr[-3000:]
    for case in CASES:
        row = re.search(rf"^{re.escape(case)} +{NUMBER} +{NUMBER} +{NUMBER}x$", run.stdout, re.M)
        assert row, run.stdout
        us, target, ratio = (float(g) for g in row.groups())
        assert abs(us / target - ratio) < 0.01, row.group(0)
