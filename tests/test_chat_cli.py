"""`tandem chat`: one question answered by a model in this process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TANDEM = str(Path(sys.executable).with_name("tandem"))


def _chat(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [TANDEM, "chat", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_a_question_is_answered_with_the_tokens_asked_for():
    done = _chat("--model", "random:tiny", "--max-tokens", "5", "What is the capital of France?")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("> What is the capital of France?\n")
    assert "[5 tokens in " in done.stderr


def test_a_bad_sampling_value_is_refused_before_the_model_loads():
    # The model does not exist: an error about it would mean it was loaded first.
    done = _chat("--model", "/no/such/model", "--max-tokens", "0", "hi")
    assert done.returncode == 2
    assert done.stderr.strip() == "tandem: error: max_tokens must be at least 1, got 0"
