"""The sampler: turns a step's logits into tokens, verifying speculative drafts.

Row layout. A sequence fed [last, x_0, ..., x_{d-1}] (its last accepted token,
then d drafts) owns 1 + d consecutive logit rows starting at `SampleRows.start`:
row j is the model's distribution p_j for output position num_generated + j,
the token after x_{j-1} (after `last` for j = 0). So row j < d verifies draft
x_j, and row d is the bonus row, used only when every draft was accepted. A
prefill (or a decode without drafts) owns one row.

Verification. The target distribution p_j is the model's after the request's
penalties and bias (logit_adjustments.py), temperature, then top-k, then
top-p. For a deterministic drafter (n-gram: the proposal q is a point mass on
x_j) speculative rejection sampling accepts x_j with probability p_j(x_j) and
otherwise samples from p_j with x_j removed. We get
exactly that by drawing y_j ~ p_j and accepting x_j iff y_j == x_j; on a
mismatch y_j is the correction (p_j conditioned on y_j != x_j). Greedy is the
same with y_j = argmax p_j. A benefit: given the same logits, a seeded request
emits the same tokens with or without speculation, whatever the drafts were.

For a drafter with its own distribution (an MTP head sampling its drafts),
pass `draft_probs` q: x_j is accepted when u * q_j(x_j) < p_j(x_j), else the
correction is drawn from norm(max(0, p_j - q_j)); the output distribution is
p either way. A row of zeros in q marks a point-mass draft (verified as
above), so a seeded request's tokens do not depend on its batch having other
rows with a q. Emitted per sequence: the accepted drafts, then one new token.

Randomness. Each row takes one uniform. A seeded request derives it from a
counter-based hash of (seed, output position, stream), not from a per-request
torch.Generator: it is stateless, vectorised over rows, independent of batch
composition and of how many draws earlier steps made, and it survives
preemption and the PROMPT -> COMPLETION handoff (no generator state to move).
Seeds are taken modulo 2**64. Unseeded rows draw from the sampler's own
generator. Sampling is inverse-CDF in two levels (blocks of the vocabulary,
then within the block) in float64, so even tail tokens of a 150k vocabulary
keep their probability.
"""

from __future__ import annotations

import torch

from tandem.engine.draws import filtered_probs, hash_uniform, inverse_cdf, seed_to_int64
from tandem.engine.logit_adjustments import adjust_logits
from tandem.engine.model import cpu_kernels
from tandem.engine.sample_rows import SampleRows

# Uniform streams: 0 draws the sampled token, 1 the accept test against draft_probs.
_STREAM_SAMPLE, _STREAM_ACCEPT = 0, 1


class Sampler:
    """Samples and verifies drafts for a step's logits; see the module docstring."""

    def __init__(self, seed: int | None = 0) -> None:
        # On the CPU whatever the logits' device: R numbers a step are cheap to
        # move, and one generator keeps unseeded draws reproducible per sampler.
        # None: a seed from the OS, so that two samplers (replicas) draw apart.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def free(self, request_id: str) -> None:
        """Drop per-request state: there is none (seeded randomness is stateless)."""

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SampleRows],
        draft_probs: torch.Tensor | None = None,
    ) -> list[list[int]]:
        """Accepted drafts then one new token, per entry of `rows`.

        logits: [R, V] float. draft_probs: optional [R, V], row-aligned with
        logits, the distribution each draft was drawn from (read on the draft
        rows of sampled sequences only); None, or a row of zeros, means a
        point-mass draft.
        """
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(f"logits must be a [rows, vocab] float tensor, got {logits.shape}")
        num_rows, vocab = logits.shape
        if draft_probs is not None and draft_probs.shape != logits.shape:
            raise ValueError(
                f"draft_probs has shape {tuple(draft_probs.shape)}, logits {(num_rows, vocab)}"
            )
        logits = adjust_logits(logits, rows)
        greedy: list[int] = []
        rand: list[int] = []
        for s in rows:
            n = 1 + len(s.drafts)
            if s.start < 0 or s.start + n > num_rows:
                raise ValueError(
                    f"request {s.request_id!r} owns logit rows [{s.start}, {s.start + n}) "
                    f"but logits have {num_rows} rows"
                )
            (greedy if s.sampling_params.temperature == 0.0 else rand).extend(
                range(s.start, s.start + n)
            )
        tokens: list[int] = [0] * num_rows
        # Per row: whether its draft passed the test against draft_probs (q rows only).
        accept: dict[int, bool] = {}
        if greedy:
            if len(greedy) == num_rows:
                tokens = _argmax(logits).tolist()
            else:
                picked = logits.index_select(0, _index(greedy, logits.device))
                for row, tok in zip(greedy, _argmax(picked).tolist(), strict=True):
                    tokens[row] = tok
        if rand:
            self._sample_random(logits, rows, rand, draft_probs, tokens, accept)
        return _emitted(rows, tokens, accept)

    def accept_greedy(self, tokens: list[int], rows: list[SampleRows]) -> list[list[int]]:
        """As `sample` for rows that are all greedy, given each row's argmax token
        (greedy_head.py computes it without the logits)."""
        for s in rows:
            if s.sampling_params.needs_logits:
                raise ValueError(
                    f"request {s.request_id!r} needs its logits "
                    "(it samples, adjusts them or reports logprobs)"
                )
            if s.start < 0 or s.start + 1 + len(s.drafts) > len(tokens):
                raise ValueError(
                    f"request {s.request_id!r} owns rows [{s.start}, "
                    f"{s.start + 1 + len(s.drafts)}) of {len(tokens)} argmax tokens"
                )
        return _emitted(rows, tokens, {})

    def _sample_random(
        self,
        logits: torch.Tensor,
        rows: list[SampleRows],
        rand: list[int],
        draft_probs: torch.Tensor | None,
        tokens: list[int],
        accept: dict[int, bool],
    ) -> None:
        """Fill `tokens` (and `accept`, with draft_probs) for the rows with temperature > 0."""
        device = logits.device
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        seeds: list[int] = []
        seeded: list[bool] = []
        positions: list[int] = []
        # Draft rows checked against draft_probs: index into `rand`, and the draft.
        q_at: list[int] = []
        q_drafts: list[int] = []
        vocab = logits.shape[1]
        for s in rows:
            params = s.sampling_params
            if params.temperature == 0.0:
                continue
            n = 1 + len(s.drafts)
            temps += [params.temperature] * n
            top_ks += [min(params.top_k or vocab, vocab)] * n
            top_ps += [params.top_p] * n
            seed = params.seed
            seeded += [seed is not None] * n
            seeds += [seed_to_int64(seed or 0)] * n
            positions.extend(range(s.num_generated, s.num_generated + n))
            if draft_probs is not None and s.drafts:
                first = len(temps) - n
                q_at.extend(range(first, first + len(s.drafts)))
                q_drafts.extend(s.drafts)
        if max(q_drafts, default=0) >= vocab or min(q_drafts, default=0) < 0:
            raise ValueError(f"a draft token id is outside the vocabulary of {vocab}")

        index = _index(rand, device)
        temps_t = torch.tensor(temps, device=device, dtype=torch.float32).unsqueeze(1)
        # A temperature under float32's smallest (1e-46, valid to the API) rounds to 0:
        # 0/0 is NaN. The smallest normal one already makes every other token -inf.
        temps_t.clamp_(min=torch.finfo(torch.float32).tiny)
        if len(rand) == len(logits) and rand == list(range(len(logits))):
            scaled = logits.float()  # every row: no gather
        else:
            scaled = logits.index_select(0, index).float()
        # Shifted by each row's max before the division, which leaves the softmax as it
        # is: a tiny temperature (1e-38) divided float32 logits into infinities, NaN
        # probabilities, and the vocabulary's last token every step.
        top = scaled.amax(dim=1, keepdim=True)
        if not bool(torch.isfinite(top).all()):
            # A model that overflowed (half precision): +inf is the likeliest token, as
            # greedy's argmax has it, and a NaN logit none (inf - inf and NaN rows drew
            # the vocabulary's last token).
            finite = torch.finfo(torch.float32)
            scaled = torch.nan_to_num(scaled, nan=-torch.inf, posinf=finite.max)
            top = scaled.amax(dim=1, keepdim=True)
        scaled = (scaled - top).div_(temps_t)
        probs = filtered_probs(scaled, top_ks, top_ps)

        seed_t = torch.tensor(seeds, device=device)
        pos_t = torch.tensor(positions, device=device)
        any_seeded = any(seeded)
        seeded_t = torch.tensor(seeded, device=device) if any_seeded else None

        def uniforms(stream: int) -> torch.Tensor:
            u = torch.rand(len(rand), dtype=torch.float64, generator=self._generator)
            if seeded_t is None:
                return u.to(device)
            return torch.where(seeded_t, hash_uniform(seed_t, pos_t, stream), u.to(device))

        if q_at:
            at = torch.tensor(q_at, device=device)
            x = torch.tensor(q_drafts, device=device).unsqueeze(1)
            q = draft_probs.index_select(0, index.index_select(0, at)).to(device, probs.dtype)
            # Rows of zeros are point-mass drafts: the y == x test below, not this one.
            with_q = q.sum(-1) > 0
            if not bool(with_q.all()):
                kept = with_q.nonzero().squeeze(1)
                at, x, q = at[kept], x[kept], q[kept]
                q_at = [q_at[i] for i in kept.tolist()]
        if q_at:
            p = probs.index_select(0, at)
            p.div_(p.sum(-1, keepdim=True))
            # Accept with probability min(1, p(x) / q(x)).
            u = uniforms(_STREAM_ACCEPT).index_select(0, at)
            passed = u * q.gather(1, x).squeeze(1) < p.gather(1, x).squeeze(1)
            residual = (p - q).clamp_(min=0.0)
            # p == q leaves no residual, but then the draft is always accepted.
            empty = residual.sum(-1, keepdim=True) <= 0
            probs.index_copy_(0, at, torch.where(empty, p, residual))
            for i, ok in zip(q_at, passed.tolist(), strict=True):
                accept[rand[i]] = ok
        sampled = inverse_cdf(probs, uniforms(_STREAM_SAMPLE)).tolist()
        for row, tok in zip(rand, sampled, strict=True):
            tokens[row] = tok


def _emitted(rows: list[SampleRows], tokens: list[int], accept: dict[int, bool]) -> list[list[int]]:
    """Per entry of rows: its drafts up to the first one its row rejects, then its row's
    token there (or after the last draft). accept holds the verdicts of drafts tested
    against draft_probs; the others pass when they equal their row's token."""
    out: list[list[int]] = []
    for s in rows:
        start, drafts = s.start, s.drafts
        emitted: list[int] = []
        for j, draft in enumerate(drafts):
            row = start + j
            ok = accept.get(row)
            if ok if ok is not None else tokens[row] == draft:
                emitted.append(draft)
            else:
                emitted.append(tokens[row])
                break
        else:
            emitted.append(tokens[start + len(drafts)])
        out.append(emitted)
    return out


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, torch's rule (the first maximum; NaN wins), for greedy rows.

    float32 CPU logits go through the C++ kernel: torch's CPU argmax is a scalar
    loop, ~3 ms a decode step for 64 rows of a 49k vocabulary against ~0.6.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0:
        ops = cpu_kernels.load()
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(-1)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
