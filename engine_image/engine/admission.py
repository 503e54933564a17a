"""Whether a request fits this engine: checked once, as it is queued.

A request that can never run is refused at once, by name, rather than queued
forever; the engine service turns each error into its protocol error code.
"""

from __future__ import annotations

from tandem.context_window import context_exceeded, prompt_too_long
from tandem.engine.config import EngineConfig


class PromptTooLongError(ValueError):
    """The prompt is longer than the engine's prompt limit."""


class ContextLengthError(ValueError):
    """The prompt leaves less room in the context than the max_tokens asked for."""


def check_fits(
    config: EngineConfig,
    num_prompt_tokens: int,
    max_tokens: int | None,
    *,
    exact_max_tokens: bool,
) -> None:
    """Raise PromptTooLongError for a prompt over config.prompt_limit. exact_max_tokens:
    the caller asked for max_tokens of room, so a prompt that leaves less raises
    ContextLengthError (else generation stops at max_model_len)."""
    if (why := prompt_too_long(num_prompt_tokens, config.max_model_len)) is not None:
        raise PromptTooLongError(why)
    if exact_max_tokens and max_tokens is not None:
        why = context_exceeded(num_prompt_tokens, max_tokens, config.max_model_len)
        if why is not None:
            raise ContextLengthError(why)
