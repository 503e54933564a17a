"""bench/gguf_read.py end to end on a small GGUF written here: its figures in
docs/benchmarks.md come from it, so it must keep running."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bench.conftest import NUMBER, run_bench
from tests.engine.test_gguf_container import write_every_kind


def test_the_gguf_bench_prints_both_readers_and_their_ratio(tmp_path: Path) -> None:
    path = tmp_path / "small.gguf"
    write_every_kind(path)
    run = run_bench("gguf_read.py", "--path", str(path), "--rounds", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    ours = re.search(rf"^tandem GGUFContainer +{NUMBER}$", out, re.M)
    theirs = re.search(rf"^gguf GGUFReader +{NUMBER}$", out, re.M)
    ratio = re.search(rf"^ratio {NUMBER}x", out, re.M)
    assert ours and theirs and ratio, out
    assert float(ratio.group(1)) == pytest.approx(
        float(theirs.group(1)) / float(ours.group(1)), rel=0.15, abs=0.15
    )
