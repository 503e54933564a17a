"""paged_attention's decode steps on both paths, and the C++ decode kernel's own op."""

from __future__ import annotations

import re

import pytest
import torch

from tests.engine.kernels import needs_kernels
from tests.engine.paged_attention_check import PATHS, make_seqs, reference, run_step


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_heads,heads", [(2, 2), (2, 8)])
def test_decode_varied_contexts(block_size: int, kv_heads: int, heads: int, kernel: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    # Contexts within and across the kernel's 128-token chunks, one ending exactly on a
    # chunk, one a token past it, one several chunks long.
    specs = [(0, 1), (7, 1), (33, 1), (127, 1), (128, 1), (300, 1)]
    seqs, num_blocks = make_seqs(specs, kv_heads, 16, block_size, gen)
    run_step(seqs, heads, block_size, num_blocks, is_prefill=False, gen=gen, kernel=kernel)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("block_size", [4, 16])
# (3, 9): an odd group (SmolLM2's), so the kernel's row pairs straddle two query
# positions with different causal limits, and one row is left over.
@pytest.mark.parametrize("kv_heads,heads", [(1, 1), (2, 8), (3, 9)])
def test_decode_with_drafts(block_size: int, kv_heads: int, heads: int, kernel: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    # Drafts straddling the kernel's chunk boundary at 128 (124 + 9 rows: the first
    # rows see none of the second chunk), and several rows per sequence.
    specs = [(12, 1 + 8), (40, 1 + 3), (5, 1), (70, 1 + 3), (124, 1 + 8)]
    seqs, num_blocks = make_seqs(specs, kv_heads, 8, block_size, gen)
    run_step(seqs, heads, block_size, num_blocks, is_prefill=False, gen=gen, kernel=kernel)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("stale", [float("nan"), float("inf")])
@pytest.mark.parametrize("drafts", [0, 3])
def test_decode_reads_nothing_past_a_sequences_context(
    kernel: bool, stale: float, drafts: int
) -> None:
    """Slots no sequence of the step owns hold non-finite values (another request's
    overflow, a freed block's leftovers): the shorter sequences of a padded batch stay
    exact on both paths, where a zero weight times inf would have made them NaN."""
    gen = torch.Generator().manual_seed(13)
    specs = [(45, 1 + drafts), (6, 1 + drafts), (23, 1 + drafts), (2, 1 + drafts)]
    seqs, num_blocks = make_seqs(specs, 2, 16, 4, gen)
    run_step(seqs, 4, 4, num_blocks, is_prefill=False, gen=gen, kernel=kernel, stale=stale)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
# The torch path: one group, a group per sequence, groups of a few.
@pytest.mark.parametrize("group_tokens", [None, 1, 40])
def test_a_later_drafts_non_finite_kv_never_reaches_the_rows_before_it(
    kernel: bool, poison: float, group_tokens: int | None
) -> None:
    """A draft whose K/V overflowed is read by its own row and the rows after it only:
    the rows before it, which decide whether it is accepted, stay exact on both paths,
    as do the shorter sequences beside stale non-finite slots. Mixed draft counts, and
    contexts that end mid-block."""
    gen = torch.Generator().manual_seed(14)
    specs = [(45, 1 + 3), (7, 1 + 1), (22, 1 + 4), (10, 1 + 2), (29, 1 + 1)]
    seqs, num_blocks = make_seqs(specs, 2, 16, 4, gen)
    run_step(
        seqs,
        4,
        4,
        num_blocks,
        is_prefill=False,
        group_tokens=group_tokens,
        gen=gen,
        kernel=kernel,
        poison=poison,
        stale=poison,
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("specs", "heads"),
    [
        # Few sequences: an item per KV head.
        ([(300, 1), (517, 1 + 3), (64, 1), (1000, 1)], 6),
        # Many: where the CPU groups KV heads, an item per sequence (3 KV heads of 2 query
        # heads, up to 3 rows a sequence).
        ([(40 + 37 * i, 1 + i % 3) for i in range(9)], 6),
        # Many, 3 query heads a KV head and up to 4 rows a sequence: 12 rows a KV head,
        # so grouped items of 2 heads and of 1 (the kernel's 32-row budget).
        ([(40 + 37 * i, 1 + i % 4) for i in range(9)], 9),
    ],
)
@pytest.mark.parametrize("threads", [2], indirect=True)
def test_kernel_spreads_a_large_step_over_threads(
    specs, heads: int, dtype: torch.dtype, threads: int
) -> None:
    # A step this large takes the kernel's OpenMP path (>= 2048 token-heads), which must
    # give the same answer.
    gen = torch.Generator().manual_seed(2)
    seqs, num_blocks = make_seqs(specs, 3, 16, 16, gen)
    run_step(seqs, heads, 16, num_blocks, is_prefill=False, dtype=dtype, gen=gen, kernel=True)


def _kernel_decode(q, k, v, cache, slots, tables, ctx, query_start, group_heads=None):
    return torch.ops.tandem_cpu.paged_decode_attention(
        q,
        k,
        v,
        cache,
        torch.tensor(slots),
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32),
        torch.tensor(query_start, dtype=torch.int32),
        q.shape[-1] ** -0.5,
        group_heads,
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_items_of_one_or_several_kv_heads_agree(dtype: torch.dtype, threads: int) -> None:
    # Work items of several KV heads of a sequence (the default on Intel CPUs: their rows
    # read together) or of one KV head each (elsewhere) do the same sums in the same
    # order: the same bits, and the reference's answer. Up to 4 rows of 3 query heads a
    # KV head: 12 rows a head, so the grouped items hold 2 heads, then 1.
    gen = torch.Generator().manual_seed(5)
    block_size, heads = 16, 9
    specs = [(40 + 37 * i, 1 + i % 4) for i in range(9)]
    seqs, num_blocks = make_seqs(specs, 3, 16, block_size, gen)
    cache = torch.zeros(2, num_blocks, block_size, 3, 16, dtype=dtype)
    flat = cache.view(2, -1, 3, 16)
    slots, tables, ctx, query_start = [], [], [], [0]
    width = max(len(s.table) for s in seqs)
    for s in seqs:
        at = [s.table[p // block_size] * block_size + p % block_size for p in range(s.k.shape[0])]
        flat[0, at[: s.start]] = s.k[: s.start].to(dtype)
        flat[1, at[: s.start]] = s.v[: s.start].to(dtype)
        slots += at[s.start :]
        tables.append(s.table + [0] * (width - len(s.table)))
        ctx.append(s.k.shape[0])
        query_start.append(query_start[-1] + s.count)
    q = torch.randn(query_start[-1], heads, 16, generator=gen).to(dtype)
    k = torch.cat([s.k[s.start :] for s in seqs]).to(dtype)
    v = torch.cat([s.v[s.start :] for s in seqs]).to(dtype)
    grouped, single, default = (
        _kernel_decode(q, k, v, cache, slots, tables, ctx, query_start, group_heads)
        for group_heads in (True, False, None)
    )
    assert torch.equal(grouped, single) and torch.equal(default, grouped)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    row = 0
    for s in seqs:
        want = reference(q[row : row + s.count], s, 16**-0.5)
        torch.testing.assert_close(grouped[row : row + s.count].double(), want, atol=tol, rtol=tol)
        row += s.count


@needs_kernels
@pytest.mark.parametrize("head_dim", [4, 16, 64])
def test_kernel_rows_never_touch_values_they_do_not_see(head_dim: int) -> None:
    # The second row's own V holds an infinity (a model gone wrong): the first row does
    # not see that position and must come out as it would without it. With 3 query
    # heads a KV head, the kernel pairs the first row's last head with the second row's
    # first (rows qi * 3 + g); a pair sharing the P.V tile up to the longer one's keys
    # turned the first row's head into NaN (0 * inf).
    gen = torch.Generator().manual_seed(8)
    ctx, rows, heads = 10, 3, 3
    k, v = (
        torch.randn(ctx, 1, head_dim, generator=gen),
        torch.randn(ctx, 1, head_dim, generator=gen),
    )
    q = torch.randn(rows, heads, head_dim, generator=gen)
    outs = []
    for second_v in (v[ctx - 2].clone(), torch.full_like(v[ctx - 2], float("inf"))):
        cache = torch.zeros(2, 3, 4, 1, head_dim)
        flat = cache.view(2, -1, 1, head_dim)
        flat[0, : ctx - rows], flat[1, : ctx - rows] = k[: ctx - rows], v[: ctx - rows]
        step_v = v[ctx - rows :].clone()
        step_v[1] = second_v
        slots = list(range(ctx - rows, ctx))
        outs.append(
            _kernel_decode(q, k[ctx - rows :], step_v, cache, slots, [[0, 1, 2]], [ctx], [0, rows])
        )
    assert torch.equal(outs[0][0], outs[1][0]) and torch.isfinite(outs[1][0]).all()
    assert not torch.isfinite(outs[1][1:]).any()  # the rows that see it do


@needs_kernels
@pytest.mark.parametrize(
    "slots,tables,ctx,query_start,message",
    [
        ([5, 12], [[0, 1], [2, 0]], [5, 3], [0, 1, 2], "slot 12 is outside the cache's 12 slots"),
        ([5, -1], [[0, 1], [2, 0]], [5, 3], [0, 1, 2], "slot -1 is outside"),
        (
            [5, 9],
            [[0, 3], [2, 0]],
            [5, 3],
            [0, 1, 2],
            "sequence 0: block 3 is outside the cache's 3 blocks",
        ),
        (
            [5, 9],
            [[0, 1], [2, 0]],
            [9, 3],
            [0, 1, 2],
            "a context of 9 needs 3 blocks, its table has 2",
        ),
        ([5, 9], [[0, 1], [2, 0]], [5, 1], [0, 0, 2], "sequence 1: 2 rows for a context of 1"),
        (
            [5, 9],
            [[0, 1], [2, 0]],
            [5, 3],
            [0, 1, 1],
            "query_start must run from 0 to the rows (2)",
        ),
    ],
)
def test_kernel_refuses_indices_outside_its_inputs(
    slots: list[int], tables: list[list[int]], ctx: list[int], query_start: list[int], message: str
) -> None:
    # The op follows these indices into the cache: out of range, it would write or read
    # outside it. The metadata never builds such a step; a caller that does gets an error.
    cache = torch.zeros(2, 3, 4, 1, 8)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        _kernel_decode(q, k, k.clone(), cache, slots, tables, ctx, query_start)
    assert not cache.any()  # refused before any write


@needs_kernels
@pytest.mark.parametrize("head_dim", [4, 24, 32, 48, 64, 128])
def test_kernel_head_dims(head_dim: int) -> None:
    # The kernel's paths by head_dim: 1, 2 or 4 vectors of 16 lanes (AVX-512) a pass, of
    # 8 lanes for the rest of the multiples of 8 (24), plain loops below (4).
    gen = torch.Generator().manual_seed(7)
    seqs, num_blocks = make_seqs([(45, 1), (3, 1 + 2), (80, 1 + 4)], 2, head_dim, 16, gen)
    run_step(seqs, 8, 16, num_blocks, is_prefill=False, gen=gen, kernel=True)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_strided_qkv(dtype: torch.dtype) -> None:
    # q, k, v as views of one fused-projection output: rows strided, no copy needed.
    gen = torch.Generator().manual_seed(8)
    seqs, num_blocks = make_seqs([(20, 1), (50, 1 + 3)], 2, 16, 4, gen)
    run_step(seqs, 8, 4, num_blocks, False, dtype=dtype, gen=gen, kernel=True, fused_qkv=True)


@needs_kernels
def test_kernel_float16() -> None:
    gen = torch.Generator().manual_seed(6)
    seqs, num_blocks = make_seqs([(20, 3), (50, 1)], 2, 16, 4, gen)
    run_step(seqs, 8, 4, num_blocks, False, dtype=torch.float16, gen=gen, kernel=True)
