"""The prompts LLM.generate takes, in vLLM's forms, read into text or token ids.

llm.generate("Hello")                                  text
llm.generate({"prompt": "Hello"})                      vLLM's TextPrompt
llm.generate({"prompt_token_ids": [1, 2, 3]})          vLLM's TokensPrompt
llm.generate(["Hello", {"prompt_token_ids": [1, 2]}])  a list of them, mixed
llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]])     token ids beside
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# One prompt as generate() takes it: text, or a dict as above.
PromptType = str | Mapping[str, Any]

# Keys of vLLM's prompt dicts this engine has no use for: refused by name, not ignored
# (an image dropped without a word answers about no image).
_UNSUPPORTED = {
    "multi_modal_data": "this engine serves text-only models",
    "mm_processor_kwargs": "this engine serves text-only models",
    "multi_modal_uuids": "this engine serves text-only models",
    "prompt_embeds": "give text or token ids",
    "token_type_ids": "a decoder takes none",
}
_IDS_HINT = " (token ids go in {'prompt_token_ids': [...]} or prompt_token_ids=[[...]])"


@dataclass(frozen=True)
class PromptInput:
    # The prompt as text, tokenized by the engine; None where token ids were given.
    text: str | None
    # The prompt's token ids as given; None where text was.
    token_ids: list[int] | None
    # vLLM's cache_salt: prefix-cache hits only among prompts with the same salt.
    cache_salt: str | None = None


def read_prompts(prompts: object, prompt_token_ids: object) -> list[PromptInput]:
    """One PromptInput per prompt, in order, or a ValueError that names what is wrong."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("give exactly one of prompts or prompt_token_ids")
    if prompt_token_ids is not None:
        return [PromptInput(None, ids) for ids in _id_lists(prompt_token_ids)]
    if isinstance(prompts, str | Mapping):
        return [_one(prompts, None)]
    if isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Sequence):
        raise ValueError(
            f"prompts must be a string, a prompt dict or a list of them, got {prompts!r:.80}"
        )
    return [_one(prompt, i) for i, prompt in enumerate(prompts)]


def _one(prompt: object, index: int | None) -> PromptInput:
    where = "" if index is None else f"prompt {index}: "
    if isinstance(prompt, str):
        return PromptInput(prompt, None)
    if not isinstance(prompt, Mapping):
        hint = _IDS_HINT if isinstance(prompt, Sequence) and prompt else ""
        raise ValueError(f"{where}a prompt is a string or a prompt dict{hint}, got {prompt!r:.80}")
    for key in prompt:
        if key in _UNSUPPORTED:
            raise ValueError(f"{where}{key!r} is not supported: {_UNSUPPORTED[key]}")
        if key not in ("prompt", "prompt_token_ids", "cache_salt"):
            raise ValueError(
                f"{where}unknown prompt key {key!r}: a prompt dict has 'prompt' (text) or "
                "'prompt_token_ids', and may have 'cache_salt'"
            )
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{where}cache_salt must be a string, got {salt!r:.40}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"{where}a prompt dict has one of 'prompt' or 'prompt_token_ids'")
    if "prompt" in prompt:
        if not isinstance(text := prompt["prompt"], str):
            raise ValueError(f"{where}'prompt' must be a string{_IDS_HINT}, got {text!r:.80}")
        return PromptInput(text, None, salt)
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
        raise ValueError(f"{where}'prompt_token_ids' is a list of token ids, got {ids!r:.40}")
    return PromptInput(None, list(ids), salt)


def _id_lists(prompt_token_ids: object) -> list[list[int]]:
    """One list of token ids per prompt (a flat list is one prompt's ids: [[...]])."""
    if not isinstance(prompt_token_ids, Sequence) or isinstance(prompt_token_ids, str):
        raise ValueError(
            f"prompt_token_ids must be a list of lists of ids, got {prompt_token_ids!r:.80}"
        )
    if prompt_token_ids and not isinstance(prompt_token_ids[0], Sequence):
        raise ValueError(
            "prompt_token_ids is a list of prompts, each a list of token ids: give [[1, 2, 3]] "
            f"for one prompt, not {prompt_token_ids!r:.40}"
        )
    for i, ids in enumerate(prompt_token_ids):
        if not isinstance(ids, Sequence) or isinstance(ids, str):
            raise ValueError(f"prompt {i}: a prompt's token ids are a list, got {ids!r:.40}")
    return [list(p) for p in prompt_token_ids]
