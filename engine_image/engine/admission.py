"""Whether a request fits this engine: checked once, as it is queued.

A request that can never run is refused at once, by name, rather than queued
forever; the engine service turns each error into its protocol error code.
"""

from __future__ import annotations

from tandem.engine.config import EngineConfig


class PromptTooLongError(ValueError):
    """The prompt is longer than the engine's prompt limit."""


class ContextLengthError(ValueError):
    """The prompt leaves less room in the context than the max_tokens asked for."""


def check_fits(
    config: EngineConfig, num_prompt_tokens: int, max_tokens: int, *, exact_max_tokens: bool
) -> None:
    """Raise PromptTooLongError for a prompt over config.prompt_limit. exact_max_tokens:
    the caller asked for max_tokens of room, so a prompt that leaves less raises
    ContextLengthError (else generation stops at max_model_len)."""
    limit = config.prompt_limit
    if num_prompt_tokens > limit:
        raise PromptTooLongError(
            f"The prompt has {num_prompt_tokens} tokens, more than this engine's limit of "
            f"{limit} (max_model_len {config.max_model_len}, less one token for the "
            "completion). Please reduce the length of the prompt."
        )
    if exact_max_tokens and num_prompt_tokens + max_tokens > config.max_model_len:
        # OpenAI's words for the same refusal: clients and people recognise them.
        raise ContextLengthError(
            f"This model's maximum context length is {config.max_model_len} tokens. However, "
            f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
            f"the prompt, {max_tokens} in the completion). Please reduce the length of the "
            "prompt or of max_tokens."
        )
