"""Helpers for the tests that run the bench scripts end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"([0-9]+(?:\.[0-9]+)?)"  # a figure the scripts print


def run_bench(script: str, *args: str) -> subprocess.CompletedProcess:
    """bench/<script> as a user runs it: `python bench/<script>` from the repository root
    (the script's directory first on sys.path: the scripts import their siblings)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
