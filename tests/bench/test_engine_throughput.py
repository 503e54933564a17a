"""bench/engine_throughput.py end to end, on a tiny random model and one round: the
engine's speed figures in docs/benchmarks.md come from it, so it must keep running
between the sessions that record them (no other test imports it)."""

from __future__ import annotations

import re

import pytest

from tests.bench.conftest import NUMBER, run_bench

# One thread: a smoke test beside other test workers, where two threads' OpenMP
# barriers spin while the other core runs someone else (the figures are not read).
QUICK = ("--model", "random:tiny", "--quick", "--rounds", "1", "--threads", "1")


@pytest.mark.slow
def test_the_engine_bench_prints_every_case_against_hf() -> None:
    run = run_bench("engine_throughput.py", *QUICK)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert re.search(rf"^machine: fp32 matmul {NUMBER} GFLOP/s, read {NUMBER} GB/s", out, re.M)
    for case in ("decode batch 64", "decode batch 1", "prefill 1024"):
        row = re.search(
            rf"^{case} \(tok/s\)\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}x\s+(?:{NUMBER}\s+)?{NUMBER}%",
            out,
            re.M,
        )
        assert row, f"no {case!r} row in:\n{out}"
        tandem, hf, ratio = (float(row.group(i)) for i in (1, 2, 3))
        assert tandem > 0 and hf > 0
        # Decode's ratio is Tandem's rate over HF's; prefill's is HF's time over Tandem's.
        assert ratio == pytest.approx(tandem / hf, rel=0.01, abs=0.01)
    for server in ("tandem (continuous)", "hf generate (static)"):
        row = re.search(rf"^{re.escape(server)}\s+{NUMBER}(\s+{NUMBER}){{4}}$", out, re.M)
        assert row and float(row.group(1)) > 0, f"no {server!r} row in:\n{out}"
    assert re.search(rf"^throughput ratio {NUMBER}x", out, re.M)
