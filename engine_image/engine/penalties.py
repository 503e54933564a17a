"""Presence and frequency penalties, as OpenAI's API defines them, on a step's logits.

A token's logit drops by `frequency_penalty` for each time the token has appeared in
the request's output so far, and by `presence_penalty` once if it has appeared at all
(negative values raise it instead). The prompt does not count, as in OpenAI's API and
vLLM. The penalties apply to the raw logits, before temperature, top-k and top-p.

A sequence verifying drafts owns rows 0..d (sampler.py): row j is used only if
drafts[:j] were accepted, so those drafts count as output for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.sampler import SampleRows


def penalize(logits: torch.Tensor, rows: list[SampleRows]) -> torch.Tensor:
    """The logits with each penalized row's penalties taken off (float32, a copy), or
    `logits` itself where no row asks for a penalty."""
    todo = [s for s in rows if s.sampling_params.penalized]
    if not todo:
        return logits
    vocab = logits.shape[1]
    out = logits.float().clone()
    for s in todo:
        counts = _output_counts(s, vocab, logits.device)  # [rows of s, vocab]
        params = s.sampling_params
        penalty = counts.mul(params.frequency_penalty).add_(
            (counts > 0).to(counts.dtype).mul_(params.presence_penalty)
        )
        out[s.start : s.start + s.num_rows].sub_(penalty)
    return out


def _output_counts(s: SampleRows, vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token appears in the output each of s's rows follows: the output
    so far, then for row j the drafts before it."""
    tokens = torch.as_tensor(list(s.output_token_ids) + s.drafts, dtype=torch.long)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(
            f"request {s.request_id!r}: an output or draft token id is outside the "
            f"vocabulary of {vocab}"
        )
    num_out = len(s.output_token_ids)
    base = torch.bincount(tokens[:num_out], minlength=vocab).to(torch.float32)
    counts = base.expand(s.num_rows, vocab).clone()
    if s.drafts:
        # Row j gains drafts[0..j-1]: one-hot rows of the drafts, summed down the rows.
        steps = torch.zeros(s.num_rows, vocab)
        steps[torch.arange(1, s.num_rows), tokens[num_out:]] = 1.0
        counts += steps.cumsum_(0)
    return counts.to(device)
