"""What the engine reports: per request and step (EngineOutput), for the last step and
since its start (StepStats, EngineTotals), and the refusal of a request's parameter."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tandem.engine.plan import TokenLogprobs


class FinishReason(StrEnum):
    """Why a request's output ended (OpenAI's words where it has one), or paused."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the context's end
    ABORT = "abort"  # cancelled, its deadline passed, or its client gone
    ERROR = "error"  # the step that ran it failed (EngineOutput.error says how)
    HANDOFF = "handoff"  # a PROMPT engine pinned its KV for a decoder: not finished


class ParameterError(ValueError):
    """A request refused for one of its parameters, which `param` names as the OpenAI
    API does: the service reports it, so a client learns which one to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class EngineOutput:
    """What one step produced for one request."""

    request_id: str
    # Tokens generated this step.
    new_token_ids: list[int]
    # Text they decode to (held back while it may still become a stop string).
    text_delta: str
    # Set once it finished, or was handed off (FinishReason.HANDOFF).
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int
    # Drafts accepted this step (speculative decoding).
    num_accepted_drafts: int = 0
    # Set with FinishReason.ERROR: what went wrong.
    error: str | None = None
    # One entry per new token, where the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None and self.finish_reason is not FinishReason.HANDOFF


@dataclass(slots=True)
class StepStats:
    """The last step, for metrics."""

    is_prefill: bool = False
    num_scheduled_tokens: int = 0
    num_seqs: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class EngineTotals:
    """Counters since the engine started, for metrics."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefix_cached_tokens: int = 0
    # Tokens of admitted requests: the denominator of the prefix-cache hit rate.
    admitted_tokens: int = 0
    preemptions: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
