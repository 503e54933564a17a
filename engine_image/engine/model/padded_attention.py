"""Decode attention at a fixed, padded shape: the attention of a captured CUDA graph.

A CUDA graph replays the kernels it recorded with the shapes they had, so a step
replayed from one must not depend on the batch's size or its contexts' lengths
except through the *values* of tensors. This path reads them so: the batch is padded
to the graph's row count, every block table to the graph's width, and each
sequence's length is a tensor the mask is computed from. It costs the gather of the
padded width's K/V (a few MiB a layer on a GPU), where the graph saves a CPU launch
per kernel (~1,200 a step for a 30-layer model: docs/benchmarks.md, "On CUDA").

Padding rows repeat row 0's inputs (token, position, slot, table, length). They
must not write K/V of their own: several rows writing one slot leave whichever
came last, so each writes row 0's K/V (write_rows), the same value wherever
the write lands. Their outputs are computed and thrown away.

Only one token per sequence (no drafts): steps that verify drafts take the
eager paths of attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """A decode step's sequences at the graph's shape: B rows, tables W blocks wide."""

    # [B] long: the row whose K/V each row writes, its own for real rows, 0 for padding.
    write_rows: torch.Tensor
    # [B, W] long block tables, padded past each sequence's blocks with any valid id
    # (masked, never read into a result).
    block_tables: torch.Tensor
    # [B] long context length of each row after this step (padding rows: row 0's).
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
    """Write k/v [B, KVH, D] at slot_mapping [B], then attend q [B, H, D] to each row's
    context through its block table; returns [B, H, D]. No op here reads a tensor's
    values on the host, so the whole step can be captured."""
    _, _, block_size, kv_heads, head_dim = kv_cache_layer.shape
    flat = kv_cache_layer.view(2, -1, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k.index_select(0, padded.write_rows))
    flat[1].index_copy_(0, slot_mapping, v.index_select(0, padded.write_rows))

    rows, width = padded.block_tables.shape
    length = width * block_size
    offsets = torch.arange(block_size, device=q.device)
    slots = (padded.block_tables[:, :, None] * block_size + offsets).view(-1)
    kv = flat.index_select(1, slots).view(2, rows, length, kv_heads, head_dim)
    past_end = torch.arange(length, device=q.device)[None, :] >= padded.context_lens[:, None]
    # Zeroed, not only masked: a slot past the end may hold another request's or a stale
    # K/V, and a -inf score or a zero weight meeting a non-finite one is NaN.
    kv = kv.masked_fill(past_end[None, :, :, None, None], 0)

    group = q.shape[1] // kv_heads
    # [B, KVH, group, D]: a KV head's query heads side by side, so K/V are read once.
    qs = (q * scale).view(rows, kv_heads, group, head_dim)
    keys = kv[0].permute(0, 2, 3, 1)  # [B, KVH, D, L]
    values = kv[1].transpose(1, 2)  # [B, KVH, L, D]
    scores = torch.matmul(qs, keys).masked_fill_(past_end[:, None, None, :], -torch.inf)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).view(rows, kv_heads * group, head_dim)
