"""What a runner's StepResult must hold for the plan it answers, checked as the
scheduler applies it (scheduler.update): a result that breaks the plan is a bug in the
runner or a lost message between ranks, and is refused by name rather than applied.

Pure Python and no torch, like the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterable

from tandem.engine.plan import ScheduledSeq, StepResult


def accepted_tokens(
    seq: ScheduledSeq, result: StepResult, num_speculative_tokens: int
) -> list[int]:
    """The tokens a sampling row accepted: a prefix of its drafts, then one new token."""
    rid = seq.request_id
    tokens = result.sampled_token_ids.get(rid)
    if not tokens:
        raise ValueError(f"step result has no sampled token for request {rid!r}")
    num_accepted = len(tokens) - 1
    if num_accepted:
        drafts = seq.draft_token_ids
        if num_accepted > len(drafts):
            raise ValueError(
                f"request {rid!r} got {len(tokens)} tokens from a step that verified "
                f"{len(drafts)} drafts: at most {1 + len(drafts)} rows (nextn + 1 = "
                f"{num_speculative_tokens + 1}) can be accepted"
            )
        if tokens[:num_accepted] != drafts[:num_accepted]:
            raise ValueError(f"request {rid!r}: accepted tokens differ from its drafts")
    return tokens


def proposed_drafts(
    request_id: str, result: StepResult, num_speculative_tokens: int
) -> list[int] | None:
    """The drafts proposed for the request's next decode step, or None: none proposed."""
    drafts = (result.draft_token_ids or {}).get(request_id)
    if drafts is not None and len(drafts) > num_speculative_tokens:
        raise ValueError(
            f"request {request_id!r}: {len(drafts)} drafts proposed, "
            f"num_speculative_tokens is {num_speculative_tokens}"
        )
    return drafts


def checked_samples(
    seqs: Iterable[ScheduledSeq], result: StepResult, num_speculative_tokens: int
) -> tuple[dict[str, list[int]], dict[str, list[int] | None]]:
    """Each sampling sequence's accepted tokens, and (with speculative decoding) the
    drafts proposed for its next step: the whole result checked before the scheduler
    applies any of it. Refused halfway, a result left a request it had finished in the
    running queue, and no decode step ran again."""
    sampled = {
        seq.request_id: accepted_tokens(seq, result, num_speculative_tokens)
        for seq in seqs
        if seq.sample
    }
    drafted = {
        rid: proposed_drafts(rid, result, num_speculative_tokens)
        for rid in sampled
        if num_speculative_tokens
    }
    return sampled, drafted
