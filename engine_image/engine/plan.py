"""The data that crosses the scheduler/runner boundary, and nothing else.

    plan = scheduler.schedule()          # StepPlan: what to compute
    result = runner.execute(plan)        # StepResult: what was sampled
    outputs = scheduler.update(plan, result)

All plain dataclasses: no torch, no behaviour. A plan is valid until the
update() that consumes it (its lists are the scheduler's own).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import RequestStatus, SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""

    # The request this slice belongs to.
    request_id: str
    # Tokens fed to the model: a prompt chunk, or (decode) the last token then the drafts.
    token_ids: list[int]
    # Position of token_ids[0] in the sequence; KV for positions below it is cached.
    start_pos: int
    # The sequence's block table: KV of position p lives in block_ids[p // block_size].
    block_ids: list[int]
    # Whether this step samples for the sequence: decode, or the last prompt chunk.
    sample: bool
    # Drafts being verified (decode): token_ids[1:] when speculating, else empty.
    draft_token_ids: list[int]
    # How to sample (the runner's sampler reads it).
    sampling_params: SamplingParams
    # Tokens sampled before this step (seeded sampling keys its randomness on it).
    num_output_tokens: int
    # The whole sequence before this step, prompt then output (live: read, never keep).
    all_token_ids: list[int]


@dataclass(slots=True)
class StepPlan:
    """What one engine step computes. Either all prefill or all decode."""

    # Prompt step (possibly empty, to keep data-parallel ranks in lockstep) or decode step.
    is_prefill: bool
    # Tokens each scheduled request computes this step (decode: 1 + its drafts).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Per-sequence inputs, in batch order.
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # Requests preempted while planning this step (their KV was freed; they recompute).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Prompt tokens whose prefill was skipped thanks to the prefix cache.
    num_prefix_cached_tokens: int = 0
    # Tokens of the requests admitted this step (what the prefix cache was asked for).
    num_admitted_tokens: int = 0
    # The decode-step counter when this step was planned (0 right after a prompt step).
    decode_step: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class StepResult:
    """What the runner produced for a plan. The scheduler keeps the lists it is given."""

    # Accepted tokens per sampled request: accepted drafts then one new token.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Drafts proposed for each request's next decode step.
    draft_token_ids: dict[str, list[int]] | None = None
    # For requests that asked for logprobs: one entry per token of sampled_token_ids.
    logprobs: dict[str, list[TokenLogprobs]] | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability under the model, and the most likely tokens
    at its position (as many as the request asked for), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class RequestOutput:
    """What a step changed for one request, as the engine reports it."""

    request_id: str
    # Tokens appended this step (after truncation at a stop).
    new_token_ids: list[int]
    # Set when the request ended this step (or went to HANDOFF on a PROMPT engine).
    status: RequestStatus
    # Drafts of the step that were accepted (speculative decoding metric).
    num_accepted_drafts: int = 0

    @property
    def finished(self) -> bool:
        return self.status.is_finished
