"""The log-probabilities a request asked for (SamplingParams.logprobs), per token.

They are the model's own: log_softmax of the raw logits, before the request's
penalties, bias, temperature, top-k and top-p (what vLLM reports by default), so
they do not change with the sampling settings. A token emitted from row j of a
sequence (sampler.py's layout: accepted drafts, then the new token) takes row j's.
"""

from __future__ import annotations

import torch

from tandem.engine.plan import TokenLogprobs
from tandem.engine.sample_rows import SampleRows


def token_logprobs(
    logits: torch.Tensor, rows: list[SampleRows], emitted: list[list[int]]
) -> dict[str, list[TokenLogprobs]]:
    """Per request of `rows` that asked for logprobs, one entry per token it emitted
    (emitted[i] for rows[i], from logit rows rows[i].start on)."""
    wanted = [
        (s, tokens)
        for s, tokens in zip(rows, emitted, strict=True)
        if s.sampling_params.logprobs is not None
    ]
    if not wanted:
        return {}
    index = [s.start + j for s, tokens in wanted for j in range(len(tokens))]
    picked = logits.index_select(0, torch.tensor(index, device=logits.device))
    logp = torch.log_softmax(picked.float(), dim=-1)
    chosen = torch.tensor([t for _, tokens in wanted for t in tokens], device=logits.device)
    chosen_logp = logp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    # A vocabulary smaller than the count asked for has them all (topk past it failed
    # the whole step, the requests beside it too).
    most = min(max(s.sampling_params.logprobs for s, _ in wanted), logp.shape[-1])
    top_logp, top_ids = logp.topk(most, dim=-1)  # most likely first (most may be 0)
    top_logp, top_ids = top_logp.tolist(), top_ids.tolist()
    out: dict[str, list[TokenLogprobs]] = {}
    at = 0
    for s, tokens in wanted:
        n = s.sampling_params.logprobs
        entries = []
        for token in tokens:
            top = tuple(zip(top_ids[at][:n], top_logp[at][:n], strict=True))
            entries.append(TokenLogprobs(token, chosen_logp[at], top))
            at += 1
        out[s.request_id] = entries
    return out
