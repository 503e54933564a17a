"""Decode attention at a fixed, padded shape: the attention of a captured CUDA graph.

A CUDA graph replays the kernels it recorded with the shapes they had, so a step
replayed from one must not depend on the batch's size or its contexts' lengths
except through the *values* of tensors. This path reads them so: the batch is padded
to the graph's B sequences of Q query rows each (Q = 1, or 1 + the drafts a step
verifies), every block table to the graph's width, and each sequence's first
position and length are tensors the masks are computed from. It costs the gather
of the padded width's K/V (a few MiB a layer on a GPU), where the graph saves a CPU
launch per kernel (~1,200 a step for a 30-layer model: docs/benchmarks.md).

Flat rows are sequence-major: row s * Q + r is sequence s's r-th token (its last
accepted one, then its drafts). Padding rows (past a sequence's tokens, or whole
padding sequences) repeat a real row's inputs. They must not write K/V of their
own: several rows writing one slot leave whichever came last, so each writes the
K/V of the row it repeats (write_rows), the same value wherever the write lands.
Their outputs are computed and thrown away.

What a row must not read it reads as nothing, as the other decode paths do, even
where it is not finite (a zero weight times inf is NaN): a hidden position's score
is set (not added) to -inf; values past each sequence's first row gather that row's
own slot of this step instead (given no weight), and a draft's value is added back,
from the step's own V rows, to the rows that read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """A decode step's sequences at the graph's shape: B sequences of Q rows, tables W
    blocks wide. Padding sequences repeat sequence 0."""

    # [B * Q] long: the row whose K/V each row writes (its own, or the one it repeats).
    write_rows: torch.Tensor
    # [B, W] long block tables, padded past each sequence's blocks with any valid id
    # (masked, never read into a result).
    block_tables: torch.Tensor
    # [B] long position of each sequence's first row (its last accepted token).
    starts: torch.Tensor
    # [B] long context length of each sequence after this step.
    context_lens: torch.Tensor


def padded_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    padded: PaddedDecode,
    scale: float,
) -> torch.Tensor:
    """Write k/v [B * Q, KVH, D] at slot_mapping [B * Q], then attend q [B * Q, H, D]
    to each row's context through its sequence's block table; returns [B * Q, H, D].
    No op here reads a tensor's values on the host, so the step can be captured."""
    _, _, block_size, kv_heads, head_dim = kv_cache_layer.shape
    flat = kv_cache_layer.view(2, -1, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.index_select(0, padded.write_rows))
    flat[1].index_copy_(0, slot_mapping, v.index_select(0, padded.write_rows))

    seqs, width = padded.block_tables.shape
    queries, length = q.shape[0] // seqs, width * block_size
    offsets = torch.arange(block_size, device=q.device)
    slots = (padded.block_tables[:, :, None] * block_size + offsets).view(seqs, length)
    position = torch.arange(length, device=q.device)
    # A slot past a sequence's end may hold another request's or a stale K/V. A key
    # there does no harm: its score is set (not added) to -inf below. A value would,
    # as a zero weight meeting a non-finite one is NaN, so values past the first row's
    # position (the step's drafts, and the end) gather the first row's own slot of
    # this step instead (finite unless the row's own value is not, and then its output
    # is not on any path), given no weight below; the drafts' are added back after.
    beyond_first = position > padded.starts[:, None]  # [B, L]
    first_slot = slot_mapping.view(seqs, queries)[:, :1]
    value_slots = torch.where(beyond_first, first_slot, slots).view(-1)
    keys = flat[0].index_select(0, slots.view(-1)).view(seqs, length, kv_heads, head_dim)
    values = flat[1].index_select(0, value_slots).view(seqs, length, kv_heads, head_dim)

    group = q.shape[1] // kv_heads
    # [B, KVH, Q * group, D]: a KV head's query rows and heads side by side, so each
    # sequence's K/V are read once for all of them.
    qs = (q * scale).view(seqs, queries, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    qs = qs.reshape(seqs, kv_heads, queries * group, head_dim)
    scores = torch.matmul(qs, keys.permute(0, 2, 3, 1)).view(seqs, kv_heads, queries, group, length)
    row = torch.arange(queries, device=q.device)
    row_end = torch.minimum(padded.starts[:, None] + row + 1, padded.context_lens[:, None])
    hidden = position >= row_end[:, :, None]  # [B, Q, L]: each row reads up to itself
    # (and never past its sequence's end: row_end is at most its length)
    scores.masked_fill_(hidden[:, None, :, None, :], -torch.inf)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    values = values.transpose(1, 2).reshape(seqs * kv_heads, length, head_dim)
    if queries == 1:  # nothing past the first row is read: beyond_first is past the end
        out = torch.bmm(probs.view(seqs * kv_heads, group, length), values)
    else:  # the drafts' part first, so that the sum rounds once in 16-bit dtypes
        drafted = _draft_values(probs, v, padded, row, length)
        weights = probs.masked_fill(beyond_first[:, None, None, None, :], 0)
        out = torch.baddbmm(
            drafted.view(seqs * kv_heads, queries * group, head_dim),
            weights.view(seqs * kv_heads, queries * group, length),
            values,
        )
    out = out.view(seqs, kv_heads, queries, group, head_dim)
    # Back to [B * Q, H, D], row-major by sequence then query row.
    return out.permute(0, 2, 1, 3, 4).reshape(seqs * queries, kv_heads * group, head_dim)


def _draft_values(
    probs: torch.Tensor, v: torch.Tensor, padded: PaddedDecode, row: torch.Tensor, length: int
) -> torch.Tensor:
    """The drafts' share of each row's output, [B, KVH, Q, group, D]: draft t (row
    1 + t, at position start + 1 + t) weighted by each row's probability for it, from
    the step's own V rows, only for rows after it (zeros elsewhere, so a non-finite
    draft reaches no row before it) and only for drafts the sequence really has."""
    seqs, kv_heads, queries, group, _ = probs.shape
    drafts = queries - 1
    draft = row[:drafts]
    position = padded.starts[:, None] + 1 + draft  # [B, T]
    real = position < padded.context_lens[:, None]
    visible = (draft[None, :] < row[:, None])[None] & real[:, None, :]  # [B, Q, T]
    index = position.clamp(max=length - 1)[:, None, None, None, :]
    weights = probs.gather(-1, index.expand(seqs, kv_heads, queries, group, drafts))
    step_values = v.view(seqs, queries, kv_heads, -1)[:, 1:].permute(0, 2, 1, 3)  # [B, KVH, T, D]
    values = torch.where(visible[:, None, :, :, None], step_values[:, :, None], 0)
    return torch.matmul(weights, values.to(probs.dtype))  # [B, KVH, Q, group, D]
