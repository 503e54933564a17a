"""A request's room in a model's context: the two refusals, worded once.

An engine refuses a request that cannot fit as it takes it (tandem.engine.admission);
the gateway refuses the ones it can tell before queueing them (gateway/context_check.py),
from the context length the engines register, in the same words: clients and people
recognise one refusal whoever made it, in OpenAI's wording.
"""

from __future__ import annotations


def past_positions(max_model_len: int, positions: int) -> str | None:
    """Why a context of `max_model_len` is refused on a model of `positions` positions,
    or None when it is not."""
    if max_model_len <= positions:
        return None
    return (
        f"max_model_len ({max_model_len}) is longer than the model's {positions} positions "
        "(max_position_embeddings): it was never trained past them; lower it"
    )


def prompt_limit(max_model_len: int) -> int:
    """The longest prompt: the prompt and its first sampled token fit the context."""
    return max_model_len - 1


def prompt_too_long(
    num_prompt_tokens: int, max_model_len: int, *, at_least: bool = False
) -> str | None:
    """Why a prompt of `num_prompt_tokens` (at least, where only a bound is known)
    never runs, or None when it fits."""
    limit = prompt_limit(max_model_len)
    if num_prompt_tokens <= limit:
        return None
    # OpenAI's first sentence: clients find a context overflow by it (and by its code).
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, the "
        f"prompt has {'at least ' if at_least else ''}{num_prompt_tokens} tokens, more than "
        f"the {limit} that leave room for one token of completion. "
        "Please reduce the length of the prompt."
    )


def completion_too_long(
    max_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> str | None:
    """Why `max_tokens` leaves no room for any prompt, or None when it leaves some.
    `field`: the request's name for it (chat's max_completion_tokens)."""
    if max_tokens < max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {max_tokens} tokens in the completion alone, which leaves no room for "
        f"the prompt. Please reduce {field}."
    )


def context_exceeded(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> str | None:
    """Why a prompt leaves less than `max_tokens` of room, or None when it leaves enough.
    `field`: the request's name for it (chat's max_completion_tokens)."""
    if num_prompt_tokens + max_tokens <= max_model_len:
        return None
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
        f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt "
        f"or of {field}."
    )


def naming_field(why: str, field: str) -> str:
    """context_exceeded's message naming the request's `field` where it named max_tokens:
    an engine does not know which of the two a chat request gave."""
    return why.replace(" or of max_tokens.", f" or of {field}.")
