"""A request's sampling parameters as the engines take them (a work item's `sampling`).

Checked here with the engine's own SamplingParams, so gateway and engine agree on
what is valid and a bad value is refused before anything is queued; OpenAI's
spellings translated (top_p 0, logit_bias's string keys, chat's logprobs switch);
each of n choices its own seed, derived from the request's.
"""

from __future__ import annotations

import hashlib
from typing import Any

from tandem.engine.request import SamplingParams
from tandem.gateway.errors import bad_request
from tandem.gateway.schemas import ChatCompletionRequest, CompletionRequest

_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
)
# Every parameter the engine's SamplingParams checks, as a refusal names it.
_CHECKED_FIELDS = (*_SAMPLING_FIELDS, "logit_bias", "logprobs")


def sampling_fields(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int
) -> dict[str, Any]:
    """The work item's sampling fields: the request's, checked, in the engine's terms."""
    fields: dict[str, Any] = {"max_tokens": max_tokens}
    for name in _SAMPLING_FIELDS[1:]:
        value = getattr(body, name)
        if value is not None:
            fields[name] = [value] if name == "stop" and isinstance(value, str) else value
    if fields.get("top_k") in (0, -1):  # vLLM's spellings of "every token": none
        del fields["top_k"]
    if fields.get("top_p") == 0:
        # OpenAI takes 0 (temperature=0, top_p=0 is a common "deterministic" recipe): the
        # nucleus shrunk to the likeliest token, which is top_k=1 to the engines.
        del fields["top_p"]
        fields["top_k"] = 1
    if body.logit_bias:
        fields["logit_bias"] = _logit_bias(body.logit_bias)
    # Chat: logprobs is a switch, top_logprobs the alternatives; completions: a count.
    if isinstance(body, ChatCompletionRequest):
        if body.logprobs:
            fields["logprobs"] = body.top_logprobs or 0
    elif body.logprobs is not None:
        fields["logprobs"] = body.logprobs
    if body.ignore_eos:
        fields["ignore_eos"] = True
    try:
        SamplingParams(**fields)  # the engine's own rules, refused here before queueing
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise bad_request(message, param if param in _CHECKED_FIELDS else None) from None
    return fields


def _logit_bias(bias: dict[str, float]) -> list[list[int | float]]:
    """OpenAI's logit_bias, token ids as JSON's string keys, as the engine's pairs (the
    engine refuses ids past its vocabulary)."""
    pairs: list[list[int | float]] = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise bad_request(
                f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias"
            )
        if len(key) > _MOST_TOKEN_ID_DIGITS:  # int() of 4,300 digits on is a ValueError
            raise bad_request(
                f"logit_bias key {key[:20]}... has {len(key)} digits: no token id is that large",
                "logit_bias",
            )
        pairs.append([int(key), value])
    return pairs


# No vocabulary comes near 10^18 tokens; longer keys are refused before int() reads them.
_MOST_TOKEN_ID_DIGITS = 18


def with_seed(sampling: dict[str, Any], index: int) -> dict[str, Any]:
    """Choice `index`'s sampling fields: its own seed where the request gave one."""
    if index == 0 or sampling.get("seed") is None:
        return sampling
    return {**sampling, "seed": derive_seed(sampling["seed"], index)}


def derive_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's own for choice 0 (so n=1 and the first
    of n agree), a hash of (seed, index) for the others (distinct, reproducible)."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
