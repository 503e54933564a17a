"""EngineConfig: every knob of the step scheduler, validated once, here.

The defaults and rules follow the deepinfer engine (see docs/scheduler.md):
the token budget per step, the prompt limit, the ALL/ANY prefill attempt
intervals and the 90 % KV watermark. No torch: the scheduler, the simulator and
the operator all import this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.context_window import past_positions, prompt_limit
from tandem.protocol import Role

# The deepinfer scheduler's name for an engine's role: the very enum the registry
# and the operator carry, so no table maps one to the other.
EngineType = Role


# A budget never drops below this many tokens by default (deepinfer/config.py).
DEFAULT_MIN_BATCHED_TOKENS = 4096


@dataclass(frozen=True)
class EngineConfig:
    engine_type: EngineType = EngineType.NORMAL
    # Longest sequence (prompt + output) the engine serves.
    max_model_len: int = 2048
    # Most sequences in flight (running) at once.
    max_num_seqs: int = 256
    # Token budget of one step; None means max(max_model_len, 4096,
    # max_num_seqs * (1 + num_speculative_tokens)).
    max_num_batched_tokens: int | None = None
    # Cut prompts that do not fit the rest of a step's budget into chunks.
    enable_chunked_prefill: bool = False
    # Drafts verified per sequence in each decode step (0: no speculation).
    num_speculative_tokens: int = 0
    # ALL point: every this many decode steps, prefill if every rank wants to.
    prefill_attempt_interval: int = 70
    # ANY point: every this many decode steps, prefill if any rank wants to.
    prefill_any_attempt_interval: int = 100
    # A rank wants prefill only while KV usage is at most this fraction.
    cache_prefill_watermark: float = 0.90
    # Tokens per KV block.
    block_size: int = 16
    # Ranks that vote on each step's type.
    data_parallel_size: int = 1
    # Reuse the KV of full blocks shared with earlier prompts.
    enable_prefix_caching: bool = True
    # The model's vocabulary; draft placeholders after prefill are vocab_size - 1.
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        try:
            engine_type = EngineType(self.engine_type)
        except ValueError:
            choices = ", ".join(t.value for t in EngineType)
            raise ValueError(
                f"engine_type must be one of {choices}, got {self.engine_type!r}"
            ) from None
        object.__setattr__(self, "engine_type", engine_type)

        # None or "false" read as off or on: prefix caching lost without a word.
        _require_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _require_bool("enable_prefix_caching", self.enable_prefix_caching)
        _require_int("max_model_len", self.max_model_len, minimum=1)
        _require_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _require_int("num_speculative_tokens", self.num_speculative_tokens, minimum=0)
        _require_int("prefill_attempt_interval", self.prefill_attempt_interval, minimum=1)
        _require_int("prefill_any_attempt_interval", self.prefill_any_attempt_interval, minimum=1)
        _require_int("block_size", self.block_size, minimum=1)
        _require_int("data_parallel_size", self.data_parallel_size, minimum=1)
        if self.vocab_size is not None:
            _require_int("vocab_size", self.vocab_size, minimum=2)
        if not isinstance(self.cache_prefill_watermark, int | float) or not (
            0.0 < self.cache_prefill_watermark <= 1.0
        ):
            raise ValueError(
                "cache_prefill_watermark is the KV usage fraction up to which a rank "
                f"takes new prompts; it must be in (0, 1], got {self.cache_prefill_watermark!r}"
            )

        if self.max_num_batched_tokens is None:
            budget = max(
                self.max_model_len,
                DEFAULT_MIN_BATCHED_TOKENS,
                self.max_num_seqs * (1 + self.num_speculative_tokens),
            )
            object.__setattr__(self, "max_num_batched_tokens", budget)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)

        budget = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and budget < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) is smaller than max_model_len "
                f"({self.max_model_len}): without chunked prefill a prompt of "
                "max_model_len tokens could never be scheduled. Raise the budget, "
                "lower max_model_len, or set enable_chunked_prefill."
            )
        decode_tokens = 1 + self.num_speculative_tokens
        if budget < decode_tokens:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) cannot hold one decode step of one "
                f"sequence with {self.num_speculative_tokens} drafts ({decode_tokens} tokens)"
            )

    @property
    def max_running(self) -> int:
        """Most sequences running at once: max_num_seqs, and no more than one decode step's
        budget holds a token of each. (With more, each decode step took the oldest again
        and the newest, their first token sent, waited for the oldest to finish.)"""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    @property
    def prompt_limit(self) -> int:
        """Longest prompt the engine accepts: the prompt and its first sampled token
        fit the context. (Without chunked prefill a prompt must also fit one step,
        and the budget is at least max_model_len, checked above.)"""
        return prompt_limit(self.max_model_len)

    @property
    def draft_placeholder_id(self) -> int | None:
        """The token id that stands for a not-yet-proposed draft."""
        return None if self.vocab_size is None else self.vocab_size - 1

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def check_fields(fields: Mapping[str, Any]) -> None:
    """EngineConfig's refusals of these fields alone, before a model loads (that takes
    minutes; a bad --block-size was a ZeroDivisionError in the KV sizing). Where the
    model is to derive max_model_len it stands in as 1, which no rule refuses: the
    derived one is capped by the budget (max_model_len_for)."""
    EngineConfig(**{"max_model_len": 1, **fields})


def max_model_len_for(fields: Mapping[str, Any], positions: int, cache_tokens: int) -> int:
    """The max_model_len of EngineConfig `fields` on a model with `positions` positions
    and a KV cache of `cache_tokens` tokens.

    Given, it must stay within the positions: past them a model was never trained,
    and it answers nonsense. Not given, the positions and what the KV cache holds
    bound it; so, without chunked prefill, does a given token budget: a sequence must
    fit one step to be prefilled (again, after a preemption). Capping this default is
    what a budget set alone means; refusing it crash-looped every pod that set one.
    """
    given = fields.get("max_model_len")
    if given is not None:
        if isinstance(given, int) and (why := past_positions(given, positions)):
            raise ValueError(why)
        return given
    length = min(positions, cache_tokens)
    budget = fields.get("max_num_batched_tokens")
    if budget is not None and not fields.get("enable_chunked_prefill", False):
        length = min(length, budget)
    return length


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
