"""Prometheus's promtool, which checks and unit-tests alerting rules (`make tools`
takes it out of Debian's prometheus package into .tools/bin)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from support.tools import tool_path


def promtool_path() -> str:
    return tool_path("promtool", "apt-get download")


def run_promtool(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=60, check=False, cwd=cwd
    )
