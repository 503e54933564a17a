"""Decode attention at a CUDA graph's fixed shape (padded_attention.py), on the CPU:
padded rows and padded block tables change nothing a real row reads or writes."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.padded_attention import PaddedDecode, padded_decode_attention
from tests.engine.paged_attention_check import Seq, make_seqs, reference


def _padded_step(
    seqs: list[Seq],
    heads: int,
    block_size: int,
    num_blocks: int,
    rows: int,
    width: int,
    dtype: torch.dtype = torch.float32,
    stale: float = 0.0,
) -> None:
    """One decode token per sequence, padded to `rows` rows and tables `width` wide as
    decode_graphs.py pads them; checks the real rows' outputs and every cache write."""
    gen = torch.Generator().manual_seed(7)
    kv_heads, head_dim = seqs[0].k.shape[1:]
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), stale, dtype=dtype)
    flat = cache.view(2, -1, kv_heads, head_dim)
    for s in seqs:
        for p in range(s.start):
            slot = s.table[p // block_size] * block_size + p % block_size
            flat[0, slot], flat[1, slot] = s.k[p], s.v[p]
    n, pad = len(seqs), rows - len(seqs)
    slots = [s.table[s.start // block_size] * block_size + s.start % block_size for s in seqs]
    tables = [s.table + [0] * (width - len(s.table)) for s in seqs]
    padded = PaddedDecode(
        write_rows=torch.tensor([*range(n), *[0] * pad]),
        block_tables=torch.tensor(tables + [tables[0]] * pad),
        context_lens=torch.tensor([s.start + 1 for s in seqs] + [seqs[0].start + 1] * pad),
    )
    q = torch.randn(rows, heads, head_dim, generator=gen)
    # Padding rows carry K/V of their own, which must never reach the cache.
    junk = torch.full((pad, kv_heads, head_dim), 9.0)
    k = torch.cat([torch.stack([s.k[s.start] for s in seqs]), junk])
    v = torch.cat([torch.stack([s.v[s.start] for s in seqs]), junk])
    slot_mapping = torch.tensor(slots + [slots[0]] * pad)
    scale = head_dim**-0.5
    out = padded_decode_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), cache, slot_mapping, padded, scale
    )
    assert out.shape == (rows, heads, head_dim) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, s in enumerate(seqs):
        want = reference(q[i : i + 1].to(dtype), s, scale)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=tol, rtol=tol)
        for half, values in ((0, s.k), (1, s.v)):
            assert torch.equal(flat[half, slots[i]], values[s.start].to(dtype))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_heads,heads", [(2, 2), (2, 8), (3, 9)])
@pytest.mark.parametrize("rows,extra_width", [(6, 0), (8, 0), (8, 3)])
def test_padded_rows_and_tables_leave_real_rows_exact(
    block_size: int, kv_heads: int, heads: int, rows: int, extra_width: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    specs = [(0, 1), (7, 1), (33, 1), (127, 1), (16, 1), (300, 1)]
    seqs, num_blocks = make_seqs(specs, kv_heads, 16, block_size, gen)
    width = max(len(s.table) for s in seqs) + extra_width
    _padded_step(seqs, heads, block_size, num_blocks, rows, width)


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
def test_slots_past_a_context_that_hold_non_finite_values_are_never_read(stale: float) -> None:
    """The padded width reaches blocks of other requests (and block 0 pads every
    table): a zero weight times inf would be NaN, so the gathered copy is zeroed."""
    gen = torch.Generator().manual_seed(13)
    seqs, num_blocks = make_seqs([(45, 1), (6, 1), (23, 1), (2, 1)], 2, 16, 4, gen)
    _padded_step(seqs, 4, 4, num_blocks, rows=8, width=16, stale=stale)


def test_bfloat16() -> None:
    gen = torch.Generator().manual_seed(3)
    seqs, num_blocks = make_seqs([(90, 1), (12, 1), (40, 1)], 3, 64, 16, gen)
    _padded_step(seqs, 9, 16, num_blocks, rows=4, width=8, dtype=torch.bfloat16)
