"""Binaries `make tools` puts in .tools/bin (helm, promtool), found for the tests.

Tests only run them, they never fetch them: without one they are skipped with
the command that fetches it, except under CI (CI=true), where a missing tool is a
broken install step and fails.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tool_path(name: str, fetched_by: str) -> str:
    """$<NAME>, else .tools/bin/<name>, else one on PATH, else skip (fail under CI)."""
    variable = name.upper()
    candidate = os.environ.get(variable) or str(ROOT / ".tools" / "bin" / name)
    if Path(candidate).is_file() and os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which(name) if os.environ.get(variable) is None else None
    if found is not None:
        return found
    message = f"no {name} at {candidate}: run `make tools` ({fetched_by} fetches it once)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
