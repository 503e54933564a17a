"""Decode attention at a CUDA graph's fixed shape (padded_attention.py), on the CPU:
padding sequences, padding rows and padded block tables change nothing a real row
reads or writes, with or without drafts."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.padded_attention import PaddedDecode, padded_decode_attention
from tests.engine.paged_attention_check import (
    Seq,
    cached_pool,
    check_written,
    make_seqs,
    reference,
    slot_of,
)


def _padded_step(
    seqs: list[Seq],
    heads: int,
    block_size: int,
    num_blocks: int,
    rows: int,
    width: int,
    queries: int = 1,
    dtype: torch.dtype = torch.float32,
    stale: float = 0.0,
    poison: float | None = None,
) -> None:
    """One step of each sequence's tokens (1 + drafts), padded to `rows` sequences of
    `queries` rows and tables `width` wide as decode_graphs.py pads them; checks the
    real rows' outputs and every cache write. stale fills the slots no sequence
    writes; poison replaces each sequence's last K and V row (a later draft the model
    overflowed on), and that row goes unchecked."""
    gen = torch.Generator().manual_seed(7)
    kv_heads, head_dim = seqs[0].k.shape[1:]
    cache = cached_pool(seqs, block_size, num_blocks, dtype, stale, poison)
    flat = cache.view(2, -1, kv_heads, head_dim)

    # Row r of a sequence is its token t = min(r, count - 1); padding sequences repeat 0.
    padded_seqs = seqs + [seqs[0]] * (rows - len(seqs))
    real = [(i, r, min(r, s.count - 1)) for i, s in enumerate(padded_seqs) for r in range(queries)]
    k = torch.stack([padded_seqs[i].k[padded_seqs[i].start + t] for i, _, t in real])
    v = torch.stack([padded_seqs[i].v[padded_seqs[i].start + t] for i, _, t in real])
    # Rows that repeat another carry K/V of their own, which must never reach the cache.
    repeats = torch.tensor([t < r or i >= len(seqs) for i, r, t in real])
    k[repeats], v[repeats] = 9.0, 9.0
    tables = [s.table + [0] * (width - len(s.table)) for s in padded_seqs]
    padded = PaddedDecode(
        write_rows=torch.tensor([(i if i < len(seqs) else 0) * queries + t for i, _, t in real]),
        block_tables=torch.tensor(tables),
        starts=torch.tensor([s.start for s in padded_seqs]),
        context_lens=torch.tensor([s.k.shape[0] for s in padded_seqs]),
    )
    slot_mapping = torch.tensor(
        [slot_of(padded_seqs[i], padded_seqs[i].start + t, block_size) for i, _, t in real]
    )
    q = torch.randn(rows * queries, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = padded_decode_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), cache, slot_mapping, padded, scale
    )
    assert out.shape == (rows * queries, heads, head_dim) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, s in enumerate(seqs):
        checked = s.count - 1 if poison is not None else s.count
        first = i * queries
        want = reference(q[first : first + checked].to(dtype), s, scale)
        torch.testing.assert_close(out[first : first + checked].double(), want, atol=tol, rtol=tol)
        check_written(flat, s, block_size, dtype)


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


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_heads,heads", [(1, 1), (2, 8), (3, 9)])
def test_drafts_padded_to_the_graphs_rows(block_size: int, kv_heads: int, heads: int) -> None:
    """Sequences verifying 0 to 4 drafts, each padded to 5 rows, and a padding
    sequence: each row reads up to its own position."""
    gen = torch.Generator().manual_seed(1)
    specs = [(12, 1 + 4), (40, 1 + 2), (5, 1), (70, 1 + 3), (0, 1 + 4)]
    seqs, num_blocks = make_seqs(specs, kv_heads, 8, block_size, gen)
    width = max(len(s.table) for s in seqs) + 1
    _padded_step(seqs, heads, block_size, num_blocks, rows=8, width=width, queries=5)


@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
@pytest.mark.parametrize("queries", [1, 4])
def test_slots_past_a_context_that_hold_non_finite_values_are_never_read(
    stale: float, queries: int
) -> None:
    """The padded width reaches blocks of other requests (and block 0 pads every
    table): a zero weight times inf would be NaN, so the gathered copy is zeroed."""
    gen = torch.Generator().manual_seed(13)
    specs = [(45, queries), (6, 1), (23, queries), (2, 1)]
    seqs, num_blocks = make_seqs(specs, 2, 16, 4, gen)
    _padded_step(seqs, 4, 4, num_blocks, rows=8, width=16, queries=queries, stale=stale)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_later_drafts_non_finite_kv_never_reaches_the_rows_before_it(poison: float) -> None:
    gen = torch.Generator().manual_seed(21)
    seqs, num_blocks = make_seqs([(30, 4), (9, 3), (50, 2)], 2, 16, 4, gen)
    _padded_step(seqs, 8, 4, num_blocks, rows=4, width=16, queries=4, poison=poison)


@pytest.mark.parametrize("queries", [1, 3])
def test_bfloat16(queries: int) -> None:
    gen = torch.Generator().manual_seed(3)
    seqs, num_blocks = make_seqs([(90, queries), (12, 1), (40, queries)], 3, 64, 16, gen)
    _padded_step(seqs, 9, 16, num_blocks, rows=4, width=8, queries=queries, dtype=torch.bfloat16)
