"""One request's lifecycle: what it asked for, what it has produced, where it is.

The scheduler owns Request objects; the runner only reads the StepPlan.
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property


class RequestStatus(Enum):
    WAITING = "waiting"  # queued for prefill (new, preempted, or mid-chunk)
    RUNNING = "running"  # prefilled; decodes each decode step
    HANDOFF = "handoff"  # PROMPT engine: prefilled, KV pinned until a decoder fetches it
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # cancelled, deadline passed, or client gone

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


# The most alternatives a token's logprobs may list (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    # Most tokens to generate; None (as vLLM's) generates until the context's end.
    max_tokens: int | None = 16
    # 0 means greedy.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p.
    top_p: float = 1.0
    # Keep only the top_k most likely tokens; None (or vLLM's 0 and -1) keeps all.
    top_k: int | None = None
    # Seed of this request's own generator; None draws from the engine's.
    seed: int | None = None
    # Token ids that end generation (besides EOS), kept in the output.
    stop_token_ids: tuple[int, ...] = ()
    # Strings that end generation; matched by the detokenizer, cut from the text.
    stop: tuple[str, ...] = ()
    # Keep generating past EOS (benchmarks).
    ignore_eos: bool = False
    # OpenAI's penalties, in [-2, 2]: a token's logit drops by presence_penalty once it
    # has appeared in the output, and by frequency_penalty for each time
    # (logit_adjustments.py).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, bias) pairs (or a mapping), each bias in
    # [-100, 100] added to that token's logit; kept sorted by token id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report each generated token's log-probability and those of this many most likely
    # tokens at its position (0-20), from the model's own distribution (before the
    # penalties, bias, temperature, top-k and top-p); None reports none.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not _is_int(self.max_tokens):
            raise ValueError(f"max_tokens must be an integer or None, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < -1):
            raise ValueError(
                f"top_k must be a positive integer, or 0, -1 or None for all, got {self.top_k!r}"
            )
        if self.top_k in (0, -1):  # vLLM's spellings of "no top-k"
            object.__setattr__(self, "top_k", None)
        if self.seed is not None and (not _is_int(self.seed)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed == -1:  # vLLM's spelling of "no seed": read as a seed, every call alike
            object.__setattr__(self, "seed", None)
        for name in ("stop_token_ids", "stop", "logit_bias"):  # vLLM's None: none of them
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        ids = _as_tuple(self.stop_token_ids)
        if ids is None or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple(self.stop)
        if stop is None or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"
            )

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes this request's logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @cached_property
    def logit_bias_arrays(self) -> tuple[array, array]:
        """logit_bias as (token ids, biases), int64 and float32 arrays in id order, made
        once: a whole vocabulary's bias rebuilt at every step held up every request in
        the batch (440 ms a step for 32 such sequences of SmolLM2's vocabulary)."""
        return array("q", (t for t, _ in self.logit_bias)), array(
            "f", (b for _, b in self.logit_bias)
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether its penalties or bias change its logits before sampling."""
        return self.penalized or bool(self.logit_bias)

    @property
    def needs_logits(self) -> bool:
        """Whether its tokens come from its logits through the sampler: every request
        but a greedy one that leaves its logits as they are and reports no logprobs,
        whose token is the model's argmax (which the greedy head finds without the
        logits)."""
        return not self.greedy or self.adjusts_logits or self.logprobs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, each checked."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [tuple(pair) for pair in pairs]
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}") from None
    seen: set[int] = set()
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {pair!r}")
        token, value = pair
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
        if not _is_real(value) or not -100.0 <= value <= 100.0:
            raise ValueError(f"logit_bias of token {token} must be in [-100, 100], got {value!r}")
        if token in seen:
            raise ValueError(f"logit_bias gives token {token} twice")
        seen.add(token)
    return tuple(sorted((token, float(value)) for token, value in pairs))


def _as_tuple(values: object) -> tuple | None:
    """A collection as a tuple; None for a value that is not one (a number, None)."""
    if isinstance(values, str | bytes | dict):
        return None
    try:
        return tuple(values)  # type: ignore[arg-type]
    except TypeError:
        return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    # Ends generation unless sampling_params.ignore_eos; set by the engine from the model.
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Higher is served first.
    priority: int = 0
    # Prompts share prefix-cache blocks only with prompts of the same salt (None: the
    # model's shared cache), as vLLM's cache_salt: one tenant cannot time another's.
    cache_salt: str | None = None

    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    # Prompt then output: one list, so a step never concatenates the prompt.
    token_ids: list[int] = field(init=False)
    # Leading tokens of token_ids whose KV is in the cache.
    num_computed_tokens: int = field(default=0, init=False)
    # Prompt tokens the prefix cache saved at its first admission (usage's cached_tokens).
    num_cached_tokens: int = field(default=0, init=False)
    # The KV manager's block table for this request (the same list), for quick reads.
    block_ids: list[int] = field(default_factory=list, init=False)
    # Drafts to verify in the next decode step.
    draft_token_ids: list[int] = field(default_factory=list, init=False)
    # Times this request was preempted and put back to recompute.
    num_preemptions: int = field(default=0, init=False)
    # Length at which it stops: prompt + max_tokens, capped by the engine's max_model_len.
    max_num_tokens: int = field(init=False)
    # Token ids that end it: the stop ids, and EOS unless ignore_eos.
    stop_token_set: frozenset[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        most = self.sampling_params.max_tokens
        # No most (None): the scheduler caps it at max_model_len as it takes the request.
        self.max_num_tokens = self.num_prompt_tokens + (most if most is not None else sys.maxsize)
        stop = set(self.sampling_params.stop_token_ids)
        if self.eos_token_id is not None and not self.sampling_params.ignore_eos:
            stop.add(self.eos_token_id)
        self.stop_token_set = frozenset(stop)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_sampled(self, tokens: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append a step's sampled tokens up to the first stop.

        Returns the tokens kept and the finish status (None while it goes on).
        """
        token_ids, stop = self.token_ids, self.stop_token_set
        token_ids.extend(tokens)
        if len(token_ids) < self.max_num_tokens and stop.isdisjoint(tokens):
            return tokens, None  # the common case: no stop anywhere
        del token_ids[len(token_ids) - len(tokens) :]
        for i, token in enumerate(tokens):
            token_ids.append(token)
            if token in stop:
                return tokens[: i + 1], RequestStatus.FINISHED_STOPPED
            if len(token_ids) >= self.max_num_tokens:
                return tokens[: i + 1], RequestStatus.FINISHED_LENGTH
        return tokens, None
