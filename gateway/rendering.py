"""Renderers: a request's results in the OpenAI shape of its endpoint.

Chat answers carry `message`/`delta` objects, completions plain `text`; both
share ids, usage and the streaming rules. Logprobs come from the engines in the
chat shape (one {"token", "logprob", "bytes", "top_logprobs"} a token); the
completions renderer turns them into that endpoint's parallel lists. Bodies are
built as plain dicts (a chunk per token batch must be cheap); tests/gateway/test_rendering.py
validates them against the pydantic models in schemas.py that the OpenAPI
schema documents.
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoiceResult:
    """What one choice produced so far."""

    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    # The engine's usage on the finish event: prompt_tokens, completion_tokens, cached_tokens.
    usage: dict[str, int] | None = None
    # Per token, where the request asked for logprobs (the chat shape).
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def total_usage(choices: Sequence[ChoiceResult], per_prompt: int | None = None) -> dict[str, Any]:
    """Usage of a whole request: each prompt once (its choices share it, as OpenAI
    counts it), the completion tokens of every choice. `per_prompt`: the choices of
    each prompt of a completions batch, in a row (None: all share one prompt)."""
    firsts = [c.usage or {} for c in choices[:: per_prompt or len(choices) or 1]]
    prompt = sum(int(u.get("prompt_tokens", 0)) for u in firsts)
    completion = sum(int((c.usage or {}).get("completion_tokens", 0)) for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(int(u.get("cached_tokens", 0)) for u in firsts)
        },
    }


class Renderer(ABC):
    """The shapes of one request's answer; subclasses fill in the endpoint's part."""

    id_prefix = ""
    object = ""
    chunk_object = ""

    def __init__(
        self,
        base_id: str,
        created: int,
        model: str,
        *,
        include_usage: bool,
        logprobs: bool = False,
        per_prompt: int | None = None,
    ) -> None:
        self.id = f"{self.id_prefix}{base_id}"
        self.created = created
        self.model = model
        self.include_usage = include_usage
        # Whether the request asked for logprobs: choices carry them, else null.
        self.logprobs = logprobs
        # The choices of each prompt of a completions batch (None: one prompt for all).
        self.per_prompt = per_prompt

    def response(self, choices: Sequence[ChoiceResult]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(i, c) for i, c in enumerate(choices)],
            "usage": total_usage(choices, self.per_prompt),
        }

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any token."""
        return []

    @abstractmethod
    def text(
        self, index: int, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """A stream chunk carrying new text of choice `index` (and its tokens' logprobs)."""

    @abstractmethod
    def finish(self, index: int, reason: str) -> dict[str, Any]:
        """The stream chunk that ends choice `index`."""

    def usage(self, choices: Sequence[ChoiceResult]) -> dict[str, Any]:
        """The last chunk of a stream with include_usage: usage, no choices."""
        return {**self._chunk([]), "usage": total_usage(choices, self.per_prompt)}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: every other chunk has usage null
        return chunk

    @abstractmethod
    def _choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        """Choice `index` of the whole (non-streamed) response."""


class ChatRenderer(Renderer):
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self, n: int) -> list[dict[str, Any]]:
        return [self._delta(i, {"role": "assistant", "content": ""}) for i in range(n)]

    def text(
        self, index: int, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return self._delta(index, {"content": text}, logprobs=self._logprobs(logprobs or []))

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._delta(index, {}, reason)

    def _delta(
        self,
        index: int,
        delta: dict[str, Any],
        reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ):
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return self._chunk([choice])

    def _choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": self._logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
        }

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return {"content": entries, "refusal": None} if self.logprobs else None


class _Offsets:
    """Where each of a choice's tokens starts in the prompt and its text, in characters:
    the tokens' bytes decoded in turn. A token holding part of a character (an emoji,
    a CJK character) adds none until the one that completes it: counted by their own
    decodes (U+FFFD each), the offsets ran past the text's end."""

    def __init__(self, start: int) -> None:
        self._chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, token_bytes: bytes) -> int:
        """The next token's offset; the offset moves past its text."""
        at = self._chars
        self._chars += len(self._decoder.decode(token_bytes))
        return at


class CompletionRenderer(Renderer):
    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, *args: Any, prompt_chars: Sequence[int] = (0,), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # text_offset counts from the prompt's start, as OpenAI's does: each prompt's
        # length (a prompt of token ids has no text here: its offsets start at 0).
        self._prompt_chars = prompt_chars
        # Per choice, where its streamed tokens have reached (text_offset).
        self._streamed: dict[int, _Offsets] = {}

    def text(
        self, index: int, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        offsets = self._streamed.setdefault(index, _Offsets(self._prompt_start(index)))
        lists = self._lists(logprobs or [], offsets)
        return self._chunk([self._text(index, text, None, lists)])

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk([self._text(index, "", reason, None)])

    def _choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        lists = self._lists(choice.logprobs, _Offsets(self._prompt_start(index)))
        return self._text(index, choice.text, choice.finish_reason, lists)

    def _prompt_start(self, index: int) -> int:
        """Where choice `index`'s text starts: after its prompt's characters."""
        return self._prompt_chars[index // self.per_prompt if self.per_prompt else 0]

    def _lists(self, entries: list[dict[str, Any]], offsets: _Offsets) -> dict[str, Any] | None:
        """The completions endpoint's logprobs: parallel lists over the tokens, each
        token's alternatives as {text: logprob}, and where each token's text starts."""
        if not self.logprobs:
            return None
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_by_text(e) for e in entries],
            "text_offset": [offsets.take(bytes(e["bytes"])) for e in entries],
        }

    @staticmethod
    def _text(
        index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": reason}


def _by_text(entry: dict[str, Any]) -> dict[str, float]:
    """The legacy format's {text: logprob}: the top alternatives and, as OpenAI's always
    has it, the token chosen (up to logprobs + 1 keys). Tokens that decode alike (parts
    of multi-byte characters all read U+FFFD) share a key, which keeps the likeliest
    (the list comes most likely first): a greedy choice shows its own logprob."""
    by_text: dict[str, float] = {}
    for t in entry["top_logprobs"]:
        by_text.setdefault(t["token"], t["logprob"])
    by_text.setdefault(entry["token"], entry["logprob"])
    return by_text
