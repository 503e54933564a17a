"""docs/offline-api.md's examples run as written, in order, in one fresh interpreter.

Every fenced block follows a `<!-- check: run -->` comment; together they are one
program (later blocks use what earlier ones defined), and what it prints is
compared with what the page says it prints.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "offline-api.md"
_MARKED = re.compile(r"<!-- check: run -->\n```python\n(.*?)\n```", re.S)


def test_every_block_is_marked() -> None:
    text = PAGE.read_text()
    assert len(_MARKED.findall(text)) == text.count("\n```") // 2


def test_the_examples_run_and_print_what_the_page_says() -> None:
    program = "\n\n".join(_MARKED.findall(PAGE.read_text()))
    result = subprocess.run(
        [sys.executable, "-P", "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "The capital of France is Paris."
    assert any(
        line.startswith("prompt 1: This model's maximum context length is")
        and "the prompt has 100000 tokens, more than" in line
        for line in lines
    ), result.stdout
    assert lines[-1].endswith("drafts accepted)"), result.stdout
    assert not lines[-1].startswith("(0 drafts"), "the n-gram drafter found nothing to draft"
