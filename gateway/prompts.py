"""The completions endpoint's `prompt` as engine prompts, and what a prompt is estimated
to cost in tokens (the engine tokenizes; the gateway only estimates).

A `prompt` is a string, token ids, or a batch of either: a list of strings or a list of
lists of token ids, answered as OpenAI and vLLM answer a batch, with n choices for each
prompt, prompt p's choice i at index p * n + i.
"""

from __future__ import annotations

import math
from typing import Any

from tandem.gateway.errors import bad_request
from tandem.gateway.messages import valid_text

# English runs ~4 characters a token. Bytes, not characters: CJK text runs about a
# token a character (3 bytes) and emoji more, where characters / 4 counted a quarter.
_BYTES_PER_TOKEN = 4


def completion_prompts(prompt: str | list[Any]) -> list[dict[str, Any]]:
    """Each prompt of the field as a work item's prompt fields ({"prompt": text} or
    {"prompt_token_ids": ids}), in order; a 400 naming the empty or invalid one."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [_one(prompt, "prompt")]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if len(prompt) == 1:
        return [_one(prompt[0], "prompt")]
    return [_one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]


def _one(prompt: str | list[int], name: str) -> dict[str, Any]:
    if not prompt:
        raise bad_request(f"{name} must not be empty", "prompt")
    if isinstance(prompt, str):
        return {"prompt": valid_text(prompt, name)}
    return {"prompt_token_ids": list(prompt)}


def naming_prompt(message: str, index: int, prompts: int) -> str:
    """`message` about prompt `index` of a request's `prompts`, naming it in a batch (one
    prompt of 50 is what to fix)."""
    return message if prompts == 1 else f"{message} (prompt {index} of the batch)"


def estimated_tokens(prompt: dict[str, Any]) -> int:
    """A completion prompt's tokens: exact for token ids, else estimated from its text."""
    if "prompt_token_ids" in prompt:
        return len(prompt["prompt_token_ids"])
    return tokens_of_size(utf8_size(prompt["prompt"]))


def tokens_of_size(utf8_bytes: int) -> int:
    """The tokens estimated for `utf8_bytes` of text (at least 1)."""
    return max(1, math.ceil(utf8_bytes / _BYTES_PER_TOKEN))


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
