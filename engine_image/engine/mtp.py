"""MTP heads: drafting from the target model's hidden states.

A multi-token-prediction head drafts from the hidden state the target model
just computed, so it runs inside the runner after the forward pass, not beside
the scheduler as the n-gram drafter does. This fits heads that read the last
hidden state alone (Medusa-style heads); DeepSeek-V3's MTP module and EAGLE
attend over earlier positions and would need every position's hidden state and
a cache per request. The runner hands it, for every sequence that sampled a
token this step, the final hidden state (after the model's final norm: the LM
head's input) at the position that produced the token, and the token:

    drafts = head.propose(hidden [n, hidden_size], tokens [n], num_drafts)

Draft j is the head's guess for the token j + 1 places after `tokens`. A head
that samples its drafts returns the distributions it drew them from, and the
next step's sampler runs standard speculative rejection sampling against
them (sampler.py): the output distribution stays the target model's. A head
that picks its drafts (argmax) returns no distributions; its drafts are point
masses, verified as n-gram drafts are.

`MtpDrafting` is the runner's side: it checks what a head returns, keeps each
request's draft distributions until the step that verifies them, and lays them
out row by row for the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.sample_rows import SampleRows


@dataclass(frozen=True, slots=True)
class MtpDrafts:
    """What an MTP head proposes for n sequences."""

    # [n, num_drafts] token ids: each sequence's drafts, in order.
    tokens: torch.Tensor
    # [n, num_drafts, vocab], or None for point masses: probs[i, j] is the
    # distribution draft j of sequence i was drawn from, given drafts < j.
    probs: torch.Tensor | None = None


class MtpHead(Protocol):
    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, num_drafts: int) -> MtpDrafts:
        """num_drafts drafts per sequence to follow `tokens` [n]; hidden [n, hidden_size] is
        the target model's final hidden state at the position whose logits gave tokens[i]."""
        ...


@dataclass(frozen=True, slots=True)
class _Proposal:
    tokens: list[int]  # the drafts as proposed
    probs: torch.Tensor  # [len(tokens), vocab]: the distributions they were drawn from


class MtpDrafting:
    """Runs an MTP head after each step and keeps its draft distributions for the next."""

    def __init__(self, head: MtpHead, num_drafts: int, vocab_size: int) -> None:
        if num_drafts < 1:
            raise ValueError(
                f"an MTP head drafts num_speculative_tokens tokens a step; it is {num_drafts}"
            )
        self.head = head
        self.num_drafts = num_drafts
        self.vocab_size = vocab_size
        self._proposals: dict[str, _Proposal] = {}  # request id -> its pending drafts' q

    def propose(
        self, request_ids: list[str], hidden: torch.Tensor, tokens: list[int]
    ) -> dict[str, list[int]]:
        """Each request's drafts after its new token tokens[i], hidden's row i behind it."""
        n, k = len(request_ids), self.num_drafts
        new = torch.tensor(tokens, dtype=torch.long, device=hidden.device)
        drafts = self.head.propose(hidden, new, k)
        if not isinstance(drafts, MtpDrafts):
            raise ValueError(f"the MTP head must return MtpDrafts, got {type(drafts).__name__}")
        ids = drafts.tokens
        if tuple(ids.shape) != (n, k) or ids.dtype.is_floating_point or ids.is_complex():
            raise ValueError(
                f"the MTP head's draft tokens must be integers [{n}, {k}], "
                f"got {ids.dtype} {list(ids.shape)}"
            )
        listed = ids.tolist()
        if any(t < 0 or t >= self.vocab_size for row in listed for t in row):
            raise ValueError(
                f"the MTP head drafted a token outside the vocabulary of {self.vocab_size}"
            )
        if drafts.probs is not None:
            self._keep(request_ids, listed, drafts.probs, hidden.device)
        else:  # point masses: nothing to keep (a stale q must not outlive its drafts)
            for rid in request_ids:
                self._proposals.pop(rid, None)
        return dict(zip(request_ids, listed, strict=True))

    def _keep(
        self,
        request_ids: list[str],
        tokens: list[list[int]],
        probs: torch.Tensor,
        device: torch.device,
    ) -> None:
        expected = (len(request_ids), self.num_drafts, self.vocab_size)
        if tuple(probs.shape) != expected or not probs.is_floating_point():
            raise ValueError(
                f"the MTP head's draft probabilities must be float {list(expected)}, "
                f"got {probs.dtype} {list(probs.shape)}"
            )
        # A copy, on the model's device: the head may reuse its output buffer.
        probs = probs.detach().to(device, torch.float32, copy=True)
        totals = probs.sum(-1, keepdim=True)
        if bool((probs < 0).any()) or not bool(((totals - 1).abs() < 1e-2).all()):
            raise ValueError(
                "the MTP head's draft probabilities must be distributions: "
                "non-negative, each summing to 1"
            )
        probs.div_(totals)  # exactly, where a 16-bit softmax came close
        drafted = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(2)
        if not bool((probs.gather(2, drafted) > 0).all()):
            # (The acceptance test u * q(x) < p(x) would pass it whatever p says.)
            raise ValueError("the MTP head drafted a token its own probabilities give 0")
        for i, (rid, drafted) in enumerate(zip(request_ids, tokens, strict=True)):
            self._proposals[rid] = _Proposal(drafted, probs[i])

    def draft_probs(self, rows: list[SampleRows], num_rows: int) -> torch.Tensor | None:
        """The sampler's draft_probs [num_rows, vocab] for `rows`, or None when no row's
        drafts came with distributions. Drafts without one (argmax drafts, placeholders
        after a handoff) keep rows of zeros, which the sampler verifies as point-mass
        drafts. Greedy rows, and rows that verify no draft, are never read: a greedy
        target is a point mass, so its draft passes exactly when it is the argmax.
        """
        found = [
            (row, self._proposals.get(row.request_id))
            for row in rows
            if row.drafts and row.sampling_params.temperature != 0.0
        ]
        if not any(p is not None for _, p in found):
            return None
        device = next(p.probs.device for _, p in found if p is not None)
        q = torch.zeros(num_rows, self.vocab_size, device=device)
        for row, proposal in found:
            m = len(row.drafts)
            # The scheduler verifies a prefix of the proposal (placeholders match none).
            if proposal is not None and proposal.tokens[:m] == row.drafts:
                q[row.start : row.start + m] = proposal.probs[:m]
        return q

    def free(self, request_id: str) -> None:
        """Forget a finished or preempted request."""
        self._proposals.pop(request_id, None)
