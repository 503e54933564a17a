"""ModelRunner: executes a StepPlan on the model and its paged KV cache.

    result = runner.execute(plan)

One forward pass over every scheduled token of the step (prompt chunks, or
each sequence's last token plus its drafts; decode steps replayed from CUDA
graphs where decode_graphs is given: decode_graphs.py), logits only for the rows that
are sampled (greedy rows: only their argmax, where the model has a greedy
head), then the sampler (which verifies drafts) and the drafter (which
proposes the next ones): the n-gram drafter from the token ids, or an MTP
head (mtp.py) from the step's hidden states. The runner keeps no per-request
state of its own beyond what the sampler and drafters hold; `free` drops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import overload

import torch

from tandem.engine.decode_graphs import DecodeGraphs
from tandem.engine.drafter import Drafter
from tandem.engine.logprobs import token_logprobs
from tandem.engine.model.attention_metadata import AttentionMetadata, decode_group_tokens
from tandem.engine.mtp import MtpDrafting, MtpHead
from tandem.engine.plan import StepPlan, StepResult, TokenLogprobs
from tandem.engine.sample_rows import SampleRows, rows_for_plan
from tandem.engine.sampler import Sampler


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        sampler: Sampler,
        drafter: Drafter | None = None,
        mtp_head: MtpHead | None = None,
        num_speculative_tokens: int = 0,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        if drafter is not None and mtp_head is not None:
            raise ValueError("give a drafter or an MTP head, not both: one proposes each step")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.drafter = drafter if num_speculative_tokens else None
        self.mtp = None
        if mtp_head is not None:
            vocab = model.config.vocab_size
            self.mtp = MtpDrafting(mtp_head, num_speculative_tokens, vocab)
        self.num_speculative_tokens = num_speculative_tokens
        self.decode_graphs = decode_graphs
        self.device = kv_caches[0].device
        # Decode batches are split into groups sized for this model's KV rows.
        self._group_tokens = decode_group_tokens(model.config, kv_caches[0].dtype, self.device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        seqs = plan.seqs
        if not seqs:  # an empty prompt step keeps data-parallel ranks in lockstep
            return StepResult()
        sample_rows: list[int] = []
        end = 0
        for seq in seqs:
            end += len(seq.token_ids)
            if seq.sample:  # the last 1 + len(drafts) rows of the sequence
                sample_rows.extend(range(end - 1 - len(seq.draft_token_ids), end))
        graphs = self.decode_graphs
        shape = graphs.shape_for(plan) if graphs is not None else None
        hidden = graphs.forward(seqs, shape) if shape is not None else self._forward(plan)
        if not sample_rows:  # only prompt chunks that sample nothing yet
            return StepResult()
        rows = rows_for_plan(plan)
        tokens, logprobs = self._sample(hidden, sample_rows, rows)
        sampled = {row.request_id: toks for row, toks in zip(rows, tokens, strict=True)}
        if self.mtp is not None:
            drafts = self._mtp_drafts(hidden, sample_rows, rows, tokens)
            return StepResult(sampled, drafts, logprobs)
        if self.drafter is None:
            return StepResult(sampled, None, logprobs)
        drafts = {}
        k = self.num_speculative_tokens
        for seq in seqs:
            accepted = sampled.get(seq.request_id)
            if accepted is not None:
                sequence = _Appended(seq.all_token_ids, accepted)
                drafts[seq.request_id] = self.drafter.propose(seq.request_id, sequence, k)
        return StepResult(sampled, drafts, logprobs)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """The final hidden states of the step's flat tokens, op by op."""
        seqs = plan.seqs
        meta = AttentionMetadata.build(
            [s.start_pos for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.block_ids for s in seqs],
            self.block_size,
            plan.is_prefill,
            self.device,
            group_tokens=self._group_tokens,
        )
        input_ids = [t for s in seqs for t in s.token_ids]
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model(ids, meta.positions, self.kv_caches, meta)

    def _mtp_drafts(
        self,
        hidden: torch.Tensor,
        positions: list[int],
        rows: list[SampleRows],
        tokens: list[list[int]],
    ) -> dict[str, list[int]]:
        """The MTP head's drafts after each entry of rows emitted tokens[i]: its new token
        came from its row after the accepted drafts (row i of `rows` is hidden's row
        positions[i])."""
        behind = [positions[r.start + len(t) - 1] for r, t in zip(rows, tokens, strict=True)]
        picked = torch.tensor(behind, dtype=torch.long).to(hidden.device, non_blocking=True)
        ids = [r.request_id for r in rows]
        return self.mtp.propose(ids, hidden.index_select(0, picked), [t[-1] for t in tokens])

    def _sample(
        self, hidden: torch.Tensor, positions: list[int], rows: list[SampleRows]
    ) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]] | None]:
        """Each entry's accepted drafts and new token, and the logprobs of those that
        asked (logprobs.py; None where none did); row i of `rows` is hidden's row
        positions[i]. Greedy rows need only their argmax, which the model's greedy head
        gives without the float32 logits (greedy_head.py); the other rows (sampled,
        adjusted by penalties or a bias, or reporting logprobs), and every row where the
        model has no greedy head, go through the logits and the sampler. Each group's
        hidden rows are gathered once, straight from the step's."""
        greedy = [r for r in rows if not r.sampling_params.needs_logits]
        argmax = None
        if greedy:
            greedy_hidden, greedy_rows = _gather(hidden, positions, greedy)
            argmax = self.model.greedy_tokens(greedy_hidden)
        if argmax is None:
            all_hidden, all_rows = _gather(hidden, positions, rows)
            logits = self.model.compute_logits(all_hidden)
            drawn = self.sampler.sample(logits, all_rows, self._draft_probs(all_rows, logits))
            return drawn, token_logprobs(logits, all_rows, drawn) or None
        logprobs = None
        tokens = dict(
            zip(
                (r.request_id for r in greedy),
                self.sampler.accept_greedy(argmax.tolist(), greedy_rows),
                strict=True,
            )
        )
        sampled = [r for r in rows if r.sampling_params.needs_logits]
        if sampled:
            sampled_hidden, sampled_rows = _gather(hidden, positions, sampled)
            logits = self.model.compute_logits(sampled_hidden)
            drawn = self.sampler.sample(
                logits, sampled_rows, self._draft_probs(sampled_rows, logits)
            )
            tokens.update(zip((r.request_id for r in sampled), drawn, strict=True))
            logprobs = token_logprobs(logits, sampled_rows, drawn) or None
        return [tokens[r.request_id] for r in rows], logprobs

    def _draft_probs(self, rows: list[SampleRows], logits: torch.Tensor) -> torch.Tensor | None:
        """The MTP head's distributions for the drafts `rows` verify (None: point masses)."""
        return None if self.mtp is None else self.mtp.draft_probs(rows, logits.shape[0])

    def drafts_for(self, request_id: str, token_ids: Sequence[int]) -> list[int] | None:
        """The drafter's proposal for a request whose tokens came from elsewhere (a KV
        handoff); None where nothing can propose before a step (no drafter, an MTP head,
        which needs the step's hidden state)."""
        if self.drafter is None:
            return None
        return self.drafter.propose(request_id, token_ids, self.num_speculative_tokens)

    def free(self, request_id: str) -> None:
        """Forget a request that finished or was preempted."""
        self.sampler.free(request_id)
        if self.drafter is not None:
            self.drafter.free(request_id)
        if self.mtp is not None:
            self.mtp.free(request_id)


def _gather(
    hidden: torch.Tensor, positions: list[int], rows: list[SampleRows]
) -> tuple[torch.Tensor, list[SampleRows]]:
    """The hidden rows of `rows` (a subset of a step's, in order; row i of the step's
    is hidden's row positions[i]) and the rows renumbered to index them."""
    index: list[int] = []
    moved: list[SampleRows] = []
    for row in rows:
        # (replace() only where the start moves: a step's ~7 us a row, cold)
        moved.append(row if row.start == len(index) else dataclasses.replace(row, start=len(index)))
        index.extend(positions[row.start : row.start + row.num_rows])
    # positions only rise: as many as hidden has are every row, in order (no copy).
    if len(index) == hidden.shape[0]:
        return hidden, moved
    picked = torch.tensor(index, dtype=torch.long).to(hidden.device, non_blocking=True)
    return hidden.index_select(0, picked), moved


class _Appended(Sequence[int]):
    """base + extra without copying base (a sequence of thousands of tokens).

    The drafter reads the sequence as it will be after this step's tokens,
    before the scheduler has appended them.
    """

    __slots__ = ("_base", "_extra", "_split")

    def __init__(self, base: list[int], extra: list[int]) -> None:
        self._base, self._extra, self._split = base, extra, len(base)

    def __len__(self) -> int:
        return self._split + len(self._extra)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        split = self._split
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if stop <= split:
                return self._base[start:stop]
            if start >= split:
                return self._extra[start - split : stop - split]
            return self._base[start:] + self._extra[: stop - split]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._base[index] if index < split else self._extra[index - split]
