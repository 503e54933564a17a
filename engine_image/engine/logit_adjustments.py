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

import torch

from tandem.engine.sample_rows import SampleRows


def adjust_logits(logits: torch.Tensor, rows: list[SampleRows]) -> torch.Tensor:
    """The logits with each row's penalties and bias applied (float32, a copy), or
    `logits` itself where no row asks for either."""
    todo = [s for s in rows if s.sampling_params.adjusts_logits]
    if not todo:
        return logits
    vocab = logits.shape[1]
    out = logits.float().clone()
    penalized = [s for s in todo if s.sampling_params.penalized]
    if penalized:
        _penalize(out, penalized, vocab)
    for s in todo:
        params = s.sampling_params
        if params.logit_bias:
            ids, biases = params.logit_bias_arrays
            if ids[-1] >= vocab:  # in id order: the last is the largest
                raise ValueError(
                    f"request {s.request_id!r}: a logit_bias token id is outside the "
                    f"vocabulary of {vocab}"
                )
            columns = torch.frombuffer(ids, dtype=torch.long).to(out.device)
            bias = torch.frombuffer(biases, dtype=torch.float32).to(out.device)
            out[s.start : s.start + s.num_rows, columns] += bias
    return out


def _penalize(out: torch.Tensor, rows: list[SampleRows], vocab: int) -> None:
    """Take the penalties off `out` in place, at the (row, token) pairs that appeared:
    a row's output is the sequence's so far, then for row j the drafts before it. Only
    those pairs are touched (a dense count row per sequence cost ~8 ms a step for 64
    penalized sequences of SmolLM2's 49k vocabulary; this ~2, most of it the copy)."""
    keys = []  # row * vocab + token, once per appearance
    frequency = torch.zeros(out.shape[0], dtype=torch.float32)
    presence = torch.zeros(out.shape[0], dtype=torch.float32)
    for s in rows:
        params, num_out = s.sampling_params, len(s.output_token_ids)
        tokens = torch.as_tensor([*s.output_token_ids, *s.drafts], dtype=torch.long)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise ValueError(
                f"request {s.request_id!r}: an output or draft token id is outside the "
                f"vocabulary of {vocab}"
            )
        for j in range(s.num_rows):
            keys.append(tokens[: num_out + j] + (s.start + j) * vocab)
        frequency[s.start : s.start + s.num_rows] = params.frequency_penalty
        presence[s.start : s.start + s.num_rows] = params.presence_penalty
    pairs, counts = torch.unique(torch.cat(keys), return_counts=True)
    if not pairs.numel():
        return
    at = pairs // vocab
    penalty = frequency[at] * counts + presence[at]
    out.view(-1).index_add_(0, pairs.to(out.device), -penalty.to(out.device))
