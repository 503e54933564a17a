"""Token draws, the sampler's arithmetic (sampler.py says why each is so):

    probs = filtered_probs(scaled_logits, top_ks, top_ps)  # unnormalised, top-k then top-p
    u = hash_uniform(seeds, positions, stream)             # a seeded row's uniform
    tokens = inverse_cdf(probs, u)                         # one token per row

Uniforms come from a counter-based hash (splitmix64) of (seed, output position,
stream): stateless, the same whatever the batch or the steps before. Draws are
inverse-CDF in two levels, a block of the vocabulary by its mass and then a token
inside it, in float64.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64 increment, as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
# top-p looks for its cutoff among this many most likely tokens before sorting a row.
_CANDIDATES = 256


def seed_to_int64(seed: int) -> int:
    seed &= _MASK64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping multiply, logical shifts by masking)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _MIX1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def hash_uniform(seed: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """A uniform in [0, 1) per element from (seed, position, stream), 53 random bits."""
    # splitmix64 twice: a stream per seed, then its (position, stream)-th output.
    counter = position * 2 + stream + 1
    z = _mix(_mix(seed + _GOLDEN) + counter * _GOLDEN)
    return ((z >> 11) & ((1 << 53) - 1)).double() * (1.0 / (1 << 53))


def filtered_probs(scaled: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Unnormalised probabilities of temperature-scaled logits after top-k then top-p.

    Both filters keep the tokens at or above a per-row cutoff logit, so ties
    at the cutoff all stay (and the result never depends on tie order): top-k
    cuts at the k-th largest logit; top-p, on the renormalised top-k
    distribution, keeps in descending order each token whose preceding mass is
    below top_p. The cutoff is looked for among the top _CANDIDATES tokens
    (no full sort); only rows whose kept mass reaches past them are sorted.
    """
    vocab = scaled.shape[1]
    device = scaled.device
    probs = torch.softmax(scaled, dim=-1)
    max_k = max((k for k in top_ks if k < vocab), default=0)
    use_p = min(top_ps) < 1.0
    if not max_k and not use_p:
        return probs
    k = torch.tensor(top_ks, device=device).unsqueeze(1)
    top_p = torch.tensor(top_ps, device=device, dtype=probs.dtype).unsqueeze(1)
    num_cand = min(vocab, max(max_k, _CANDIDATES if use_p else 0))
    cutoff, spill = _cutoffs(scaled, probs, k, top_p, num_cand)
    if spill is not None and bool(spill.any()):
        rows = spill.nonzero().squeeze(1)
        full, _ = _cutoffs(scaled[rows], probs[rows], k[rows], top_p[rows], vocab)
        cutoff.index_copy_(0, rows, full)
    return probs.masked_fill_(scaled < cutoff, 0.0)


def _cutoffs(
    scaled: torch.Tensor, probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, num_cand: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row cutoff logits [n, 1] from the top num_cand tokens, and the rows
    whose top-p cutoff may lie beyond them (None when num_cand covers the vocabulary)."""
    vocab = scaled.shape[1]
    vals, idx = scaled.topk(num_cand, dim=-1)  # sorted, descending
    has_k = k < vocab
    kth = vals.gather(1, k.clamp(max=num_cand) - 1)
    cutoff = torch.where(has_k, kth, float("-inf"))
    if not bool((top_p < 1.0).any()):
        return cutoff, None
    in_k = torch.softmax(vals.masked_fill(vals < cutoff, float("-inf")), dim=-1)
    cand = torch.where(has_k, in_k, probs.gather(1, idx))
    before = cand.cumsum(-1).sub_(cand)
    # Top-p keeps at least the most likely token, even for a top_p that rounds to 0.
    num_kept = (before < top_p).sum(-1, keepdim=True).clamp_(min=1)
    use_p = top_p < 1.0
    cutoff = torch.where(use_p, torch.maximum(cutoff, vals.gather(1, num_kept - 1)), cutoff)
    if num_cand == vocab:
        return cutoff, None
    # Every candidate kept and still short of top_p: the cutoff is further down.
    spill = use_p & ~has_k & (before[:, -1:] + cand[:, -1:] < top_p)
    return cutoff, spill.squeeze(1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of non-negative (unnormalised) `probs` for uniforms `u`.

    Two levels keep float64 precision cheap: pick a block of the vocabulary by
    its mass, then a token inside it by its share of the block. Tokens of
    probability 0 are never picked.
    """
    n, vocab = probs.shape
    block = _block_size(vocab)
    num_blocks = -(-vocab // block)
    if num_blocks * block != vocab:
        probs = torch.nn.functional.pad(probs, (0, num_blocks * block - vocab))
    blocks = probs.view(n, num_blocks, block)
    mass = blocks.sum(-1).double()
    cdf = mass.cumsum(-1)
    total = cdf[:, -1:].contiguous()
    x = u.unsqueeze(1) * total
    # x can round up to total; the clamp lands on the last block with mass.
    b = torch.minimum(
        torch.searchsorted(cdf, x, right=True), torch.searchsorted(cdf, total)
    ).clamp_(max=num_blocks - 1)
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp_(min=0)), 0.0)
    # The draw's place inside the block, in [0, 1); rounding must not push it below 0,
    # where a leading zero-probability token would be picked.
    share = ((x - before) / mass.gather(1, b)).clamp_(min=0.0)
    inner = blocks.gather(1, b.unsqueeze(2).expand(n, 1, block)).squeeze(1)
    inner_cdf = inner.double().cumsum_(-1)
    inner_total = inner_cdf[:, -1:].contiguous()
    i = torch.minimum(
        torch.searchsorted(inner_cdf, share * inner_total, right=True),
        torch.searchsorted(inner_cdf, inner_total),
    ).clamp_(max=block - 1)
    return (b * block + i).squeeze(1)


def _block_size(vocab: int) -> int:
    if vocab <= 256:
        return vocab
    return next((b for b in (256, 128, 64) if vocab % b == 0), 256)
