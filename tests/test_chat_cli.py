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
    # The answer alone on stdout, a line of its own; the question and figures on stderr.
    assert done.stdout.endswith("\n") and done.stdout.count("\n") >= 1
    assert "> What is the capital of France?\n" in done.stderr
    assert "[5 tokens in " in done.stderr


def test_a_bad_sampling_value_is_refused_before_the_model_loads():
    # The model does not exist: an error about it would mean it was loaded first.
    done = _chat("--model", "/no/such/model", "--max-tokens", "0", "hi")
    assert done.returncode == 2
    assert done.stderr.strip() == "tandem: error: max_tokens must be at least 1, got 0"


def test_a_model_without_a_tokenizer_is_one_error_line(tmp_path):
    _save_tiny_llama(tmp_path)  # no tokenizer.json
    done = _chat("--model", str(tmp_path), "--max-tokens", "2", "hi")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"tandem: error: {tmp_path} has no tokenizer (tokenizer.json), so no chat template"
    )


def test_a_model_without_a_chat_template_is_named_as_a_base_model(tmp_path):
    # It said "send a plain prompt instead", which `tandem chat` has no way to do.
    import tokenizers

    words = {"[UNK]": 0, "hi": 1, "there": 2}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    _save_tiny_llama(tmp_path)
    done = _chat("--model", str(tmp_path), "--max-tokens", "2", "hi there")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tandem: error: {tmp_path} has no chat template (a base model?)")


def _save_tiny_llama(folder: Path) -> None:
    """A one-layer Llama's config and weights, and nothing else, in `folder`."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def test_a_reader_that_stops_early_ends_it_quietly():
    # `tandem chat ... | head -c 3`: a BrokenPipeError traceback before.
    command = f"'{TANDEM}' chat --model random:tiny --max-tokens 300 hi | head -c 3"
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr
