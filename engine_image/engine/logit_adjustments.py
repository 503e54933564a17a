"""What a request's own parameters change in its logits before the sampler draws:
OpenAI's presence and frequency penalties and its logit_bias.

Penalties: a token's logit drops by `frequency_penalty` for each time the token has
appeared in the request's output so far, and by `presence_penalty` once if it has
appeared at all (negative values raise it instead). The prompt does not count, as in
OpenAI's API and vLLM. A sequence verifying drafts owns rows 0..d (sampler.py): row j
is used only if drafts[:j] were accepted, so those drafts count as output for it.

Bias: `logit_bias` adds its value to its token's logit on every row (-100 all but
bans a token, 100 all but forces it).

Both apply to the raw logits, before temperature, top-k and top-p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.engine.sampler import SampleRows


def adjust_logits(logits: torch.Tensor, rows: list[SampleRows]) -> torch.Tensor:
    """The logits with each row's penalties and bias applied (float32, a copy), or
    `logits` itself where no row asks for either."""
    todo = [s for s in rows if s.sampling_params.adjusts_logits]
    if not todo:
        return logits
    vocab = logits.shape[1]
    out = logits.float().clone()
    for s in todo:
        params, mine = s.sampling_params, out[s.start : s.start + s.num_rows]
        if params.penalized:
            counts = _output_counts(s, vocab, logits.device)  # [rows of s, vocab]
            penalty = counts.mul(params.frequency_penalty).add_(
                (counts > 0).to(counts.dtype).mul_(params.presence_penalty)
            )
            mine.sub_(penalty)
        if params.logit_bias:
            ids = [token for token, _ in params.logit_bias]
            if max(ids) >= vocab:
                raise ValueError(
                    f"request {s.request_id!r}: a logit_bias token id is outside the "
                    f"vocabulary of {vocab}"
                )
            bias = torch.tensor([b for _, b in params.logit_bias], device=out.device)
            mine[:, torch.tensor(ids, device=out.device)] += bias
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
