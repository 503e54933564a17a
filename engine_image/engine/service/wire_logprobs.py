"""A step's token logprobs in the shape the response stream carries: OpenAI's chat
logprobs, each token with its text and UTF-8 bytes, which the gateway cannot make
(it has no tokenizer).

A token's text is its own decode, as vLLM gives it (a SentencePiece token with its
leading space, Tokenizer.token_text): a token holding part of a multi-byte
character decodes to U+FFFD. Its bytes are its own, as OpenAI gives
them, so that a client joins a run of such tokens into the character.
"""

from __future__ import annotations

from typing import Any

from tandem.engine.engine_output import EngineOutput, FinishReason
from tandem.engine.plan import TokenLogprobs
from tandem.engine.tokenizer import Tokenizer


def wire_logprobs(
    entries: list[TokenLogprobs], tokenizer: Tokenizer | None
) -> list[dict[str, Any]]:
    """One dict per entry: {"token", "logprob", "bytes", "top_logprobs": [...]}."""

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        # Without a tokenizer (token-id models) the id stands in for the text.
        if tokenizer is None:
            text, raw = f"<{token_id}>", f"<{token_id}>".encode()
        else:
            text, raw = tokenizer.token_text(token_id), tokenizer.token_bytes(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return [
        {
            **token(entry.token_id, entry.logprob),
            "top_logprobs": [token(i, lp) for i, lp in entry.top],
        }
        for entry in entries
    ]


def listed_logprobs(out: EngineOutput, tokenizer: Tokenizer | None) -> list[TokenLogprobs]:
    """The logprobs a client sees: those of the tokens in its text. The token that
    ended a request and wrote nothing (EOS, a special stop id) is not listed, as
    OpenAI lists none (the offline API keeps it, with the token ids)."""
    entries = out.logprobs or []
    ended = out.finish_reason is FinishReason.STOP and entries and tokenizer is not None
    if ended and tokenizer.decode([entries[-1].token_id]) == "":
        return entries[:-1]
    return entries
