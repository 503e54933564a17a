"""SampleRows: which logit rows of a step belong to which sequence, and what it samples.

A sequence fed its last accepted token and d drafts owns 1 + d consecutive rows; the
layout, and how the rows verify the drafts, are in sampler.py. The runner, the
sampler, the penalties (logit_adjustments.py), logprobs and the MTP drafter all read
the rows; rows_for_plan() packs them for a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.plan import StepPlan
from tandem.engine.request import SamplingParams


@dataclass(slots=True)
class SampleRows:
    """One sequence's logit rows: 1 + len(drafts) of them from `start`."""

    request_id: str
    # First logit row of this sequence.
    start: int
    # Drafts being verified; row j < len(drafts) verifies drafts[j].
    drafts: list[int]
    sampling_params: SamplingParams
    # Output tokens before this step: row j samples output position num_generated + j.
    num_generated: int
    # Those tokens, for the penalties (logit_adjustments.py); empty where none applies.
    output_token_ids: Sequence[int] = ()

    @property
    def num_rows(self) -> int:
        return 1 + len(self.drafts)


def rows_for_plan(plan: StepPlan) -> list[SampleRows]:
    """The rows of the sampled sequences of a plan, packed in batch order.

    The runner gathers the logits of each sampled sequence's last 1 + d
    positions in this order (a prefill chunk that does not end its prompt
    samples nothing and owns no row).
    """
    rows: list[SampleRows] = []
    start = 0
    for seq in plan.seqs:
        if seq.sample:
            drafts, generated = seq.draft_token_ids, seq.num_output_tokens
            output: Sequence[int] = ()
            if seq.sampling_params.penalized:  # the sequence's tail (a copy: it is live)
                output = seq.all_token_ids[len(seq.all_token_ids) - generated :]
            rows.append(
                SampleRows(seq.request_id, start, drafts, seq.sampling_params, generated, output)
            )
            start += 1 + len(drafts)
    return rows
