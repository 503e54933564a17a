"""Drive a Scheduler without a model: a stand-in runner that samples given tokens."""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.config import EngineConfig
from tandem.engine.plan import RequestOutput, ScheduledSeq, StepPlan, StepResult
from tandem.engine.request import SamplingParams
from tandem.engine.scheduler import Scheduler

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)  # decodes until stopped

# Chooses the tokens a sequence "samples" this step: accepted drafts then one new token.
TokenFn = Callable[[ScheduledSeq], list[int]]


def make(num_blocks=4096, **fields) -> Scheduler:
    """A scheduler on one rank, EngineConfig(**fields), with num_blocks KV blocks."""
    return Scheduler(EngineConfig(**fields), num_blocks=num_blocks)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def next_token(seq: ScheduledSeq) -> list[int]:
    """Reject every draft and sample a token derived from the position (never EOS-like)."""
    return [1000 + (seq.start_pos + len(seq.token_ids)) % 7]


def accept_all(seq: ScheduledSeq) -> list[int]:
    """Accept every draft, then one more token."""
    return [*seq.draft_token_ids, next_token(seq)[0]]


def fake_result(plan: StepPlan, tokens: TokenFn = next_token) -> StepResult:
    return StepResult({s.request_id: tokens(s) for s in plan.seqs if s.sample})


def step(
    scheduler: Scheduler, tokens: TokenFn = next_token
) -> tuple[StepPlan, list[RequestOutput]]:
    plan = scheduler.schedule()
    return plan, scheduler.update(plan, fake_result(plan, tokens))


def run_until_idle(scheduler: Scheduler, max_steps: int = 100_000) -> list[StepPlan]:
    plans = []
    while scheduler.has_unfinished_requests():
        if len(plans) >= max_steps:
            raise AssertionError(f"not idle after {max_steps} steps")
        plans.append(step(scheduler)[0])
    return plans
