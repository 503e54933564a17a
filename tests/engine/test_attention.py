"""paged_attention against dense causal attention computed from unpaged K/V.

Decode steps run on both paths: the C++ kernel (cpu_kernels.py; skipped where it
cannot be built) and the pure-torch fallback, forced with build(kernel=False).
Prefill takes the C++ kernel for head dims that are multiples of 32, SDPA
otherwise; tests force SDPA by making cpu_kernels.load() return None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.model import attention, cpu_kernels
from tandem.engine.model.attention import paged_attention
from tandem.engine.model.attention_metadata import AttentionMetadata
from tests.engine.kernels import needs_kernels

# The decode paths: the C++ kernel, the torch fallback.
PATHS = [pytest.param(True, id="kernel", marks=needs_kernels), pytest.param(False, id="torch")]


@dataclass
class Seq:
    """A sequence's full K/V (as if never paged) and the slice this step feeds."""

    k: torch.Tensor  # [context, KVH, D]
    v: torch.Tensor
    start: int
    table: list[int]

    @property
    def count(self) -> int:
        return self.k.shape[0] - self.start


def reference(q: torch.Tensor, seq: Seq, scale: float) -> torch.Tensor:
    """Dense attention of the step's rows over the whole sequence, float64, each row
    over its own prefix only (so that no later position's values reach it at all)."""
    group = q.shape[1] // seq.k.shape[1]
    k = seq.k.double().repeat_interleave(group, 1)
    v = seq.v.double().repeat_interleave(group, 1)
    rows = []
    for i, row in enumerate(q.double()):
        end = seq.start + i + 1
        weights = (torch.einsum("hd,khd->hk", row, k[:end]) * scale).softmax(-1)
        rows.append(torch.einsum("hk,khd->hd", weights, v[:end]))
    return torch.stack(rows)


def run_step(
    seqs: list[Seq],
    heads: int,
    block_size: int,
    num_blocks: int,
    is_prefill: bool,
    dtype: torch.dtype = torch.float32,
    group_tokens: int | None = None,
    gen: torch.Generator | None = None,
    kernel: bool | None = None,
    fused_qkv: bool = False,
    tol: float | None = None,
    stale: float = 0.0,
    poison: float | None = None,
) -> None:
    """Cache the prefixes, run one step, check outputs and the written cache.

    kernel picks the decode path (AttentionMetadata.build); fused_qkv passes q, k, v as
    strided views of one [T, (H + 2 KVH) * D] tensor, as a fused projection makes them;
    tol overrides the dtype's tolerance against the float64 reference; stale fills the
    cache's slots that no sequence writes; poison replaces each sequence's last K and V
    row (a later draft the model overflowed on), and that row goes unchecked.
    """
    kv_heads, head_dim = seqs[0].k.shape[1:]
    if poison is not None:
        for s in seqs:
            s.k[-1], s.v[-1] = poison, poison
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), stale, dtype=dtype)
    flat = cache.view(2, -1, kv_heads, head_dim)
    for s in seqs:
        for p in range(s.start):
            slot = s.table[p // block_size] * block_size + p % block_size
            flat[0, slot], flat[1, slot] = s.k[p], s.v[p]
    meta = AttentionMetadata.build(
        [s.start for s in seqs],
        [s.count for s in seqs],
        [s.table for s in seqs],
        block_size,
        is_prefill,
        "cpu",
        group_tokens=group_tokens,
        kernel=kernel,
    )
    if not is_prefill:
        assert (meta.paged is not None) == bool(kernel) or kernel is None
        assert (meta.decode is None) == (meta.paged is not None)
    expected_pos = torch.cat([torch.arange(s.start, s.k.shape[0]) for s in seqs])
    assert torch.equal(meta.positions, expected_pos)
    q = torch.randn(sum(s.count for s in seqs), heads, head_dim, generator=gen)
    k = torch.cat([s.k[s.start :] for s in seqs])
    v = torch.cat([s.v[s.start :] for s in seqs])
    scale = head_dim**-0.5
    q_in, k_in, v_in = q.to(dtype), k.to(dtype), v.to(dtype)
    if fused_qkv:
        rows, heads_q = q.shape[:2]
        qkv = torch.cat([t.reshape(rows, -1) for t in (q_in, k_in, v_in)], dim=1)
        sizes = [heads_q * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        q_in, k_in, v_in = (part.view(rows, -1, head_dim) for part in qkv.split(sizes, dim=1))
        assert not q_in.is_contiguous()
    out = paged_attention(q_in, k_in, v_in, cache, meta, scale)
    assert out.shape == q.shape and out.dtype == dtype
    if tol is None:
        tol = {torch.float32: 1e-5, torch.float16: 5e-3}.get(dtype, 3e-2)
    row = 0
    for s in seqs:
        checked = s.count - 1 if poison is not None else s.count
        want = reference(q[row : row + checked].to(dtype), s, scale)
        torch.testing.assert_close(out[row : row + checked].double(), want, atol=tol, rtol=tol)
        row += s.count
        for p in range(s.start, s.k.shape[0]):
            slot = s.table[p // block_size] * block_size + p % block_size
            for half, values in ((0, s.k), (1, s.v)):
                torch.testing.assert_close(
                    flat[half, slot], values[p].to(dtype), rtol=0, atol=0, equal_nan=True
                )


def make_seqs(
    specs: list[tuple[int, int]],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    gen: torch.Generator,
    shared_prefix_blocks: int = 0,
) -> tuple[list[Seq], int]:
    """Sequences (start, count) with block tables scattered over a pool.

    With shared_prefix_blocks, every sequence's first blocks (and their K/V) are the
    first sequence's, as prefix reuse would leave them.
    """
    needs = [-(-(start + count) // block_size) for start, count in specs]
    num_blocks = sum(needs) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for (start, count), need in zip(specs, needs, strict=True):
        table = [pool.pop() for _ in range(need)]
        k = torch.randn(start + count, kv_heads, head_dim, generator=gen)
        v = torch.randn(start + count, kv_heads, head_dim, generator=gen)
        if seqs and shared_prefix_blocks:
            shared = shared_prefix_blocks * block_size
            if start < shared:
                raise ValueError("a shared prefix must be cached")
            table[:shared_prefix_blocks] = seqs[0].table[:shared_prefix_blocks]
            k[:shared], v[:shared] = seqs[0].k[:shared], seqs[0].v[:shared]
        seqs.append(Seq(k, v, start, table))
    return seqs, num_blocks


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


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kv_heads,heads", [(2, 2), (1, 4)])
def test_prefill_from_scratch(block_size: int, kv_heads: int, heads: int) -> None:
    gen = torch.Generator().manual_seed(2)
    seqs, num_blocks = make_seqs([(0, 37), (0, 1), (0, 16)], kv_heads, 16, block_size, gen)
    run_step(seqs, heads, block_size, num_blocks, is_prefill=True, gen=gen)


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_second_chunk_reads_first(block_size: int) -> None:
    gen = torch.Generator().manual_seed(3)
    # Chunk 2 of two prompts (chunk 1 cached), one not block-aligned, beside a fresh prompt.
    seqs, num_blocks = make_seqs([(32, 20), (0, 9), (13, 30)], 2, 16, block_size, gen)
    run_step(seqs, 8, block_size, num_blocks, is_prefill=True, gen=gen)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("kv_heads,heads", [(3, 3), (2, 8)])
def test_prefill_head_dims_on_both_paths(
    head_dim: int, kv_heads: int, heads: int, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Head dims the C++ prefill kernel takes (multiples of 32); prompts across its
    # 64-position blocks and 64-token tiles, fresh and after cached chunks.
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    gen = torch.Generator().manual_seed(9)
    specs = [(0, 130), (0, 1), (64, 64), (13, 100), (0, 37)]
    seqs, num_blocks = make_seqs(specs, kv_heads, head_dim, 16, gen)
    run_step(seqs, heads, 16, num_blocks, is_prefill=True, gen=gen, fused_qkv=head_dim == 64)


@needs_kernels
def test_prefill_takes_the_kernel_only_where_it_applies() -> None:
    def takes(head_dim: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> bool:
        q = torch.randn(3, 4, head_dim, dtype=dtype, requires_grad=grad)
        k = v = torch.randn(3, 2, head_dim, dtype=dtype)
        return attention._prefill_kernel(q, k, v) is not None

    assert takes(32) and takes(64) and takes(128) and takes(64, torch.float16)
    # bfloat16 where the CPU has AMX: SDPA's flash kernel multiplies on its tiles.
    assert takes(64, torch.bfloat16) == (not cpu_kernels.load().amx_ready())
    assert not takes(16)  # not a multiple of the kernel's 32-wide tiles: SDPA
    assert not takes(64, torch.float64)  # a dtype the kernels do not take
    assert not takes(64, grad=True)  # autograd needs SDPA's backward
    with torch.no_grad():
        assert takes(64, grad=True)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_kernel_half_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    seqs, num_blocks = make_seqs([(0, 70), (40, 30)], 2, 32, 16, gen)
    run_step(seqs, 8, 16, num_blocks, is_prefill=True, dtype=dtype, gen=gen, fused_qkv=True)
    # The kernel itself, which the step above may leave to SDPA (bfloat16 with AMX).
    for s in seqs:
        q = torch.randn(s.count, 8, 32, generator=gen).to(dtype)
        out = cpu_kernels.load().causal_attention(q, s.k.to(dtype), s.v.to(dtype), 32**-0.5)
        want = reference(q, s, 32**-0.5)
        torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)


@needs_kernels
@pytest.mark.parametrize("is_prefill", [True, False])
def test_kernels_on_scores_past_float32s_normal_range(is_prefill: bool, threads: int) -> None:
    """Scores ~30x as spread as usual (a sharp head: many probabilities under 2^-126,
    which the kernels flush to zero, kernel_common.h's FlushDenormals) still match the
    float64 reference, and every thread's own denormal mode is back afterwards."""
    gen = torch.Generator().manual_seed(12)
    specs = [(0, 150), (60, 90)] if is_prefill else [(150, 1), (61, 5), (300, 1)]
    seqs, num_blocks = make_seqs(specs, 2, 32, 16, gen)
    for s in seqs:
        s.k *= 30.0  # with q ~ N(0, 1): scores ~ N(0, 30^2)
    tiny = torch.full((1 << 16,), 1e-39)  # made now: under flushing, it would be 0
    assert tiny.view(torch.int32).all(), "this thread flushes denormals already"
    # float32 scores of ~100 carry errors of ~1e-5, which the softmax passes on (as much
    # with denormals kept).
    run_step(seqs, 4, 16, num_blocks, is_prefill, gen=gen, kernel=True, tol=1e-4)
    # A denormal survives arithmetic on the calling thread and on torch's others
    # (compared as bits: a float comparison would flush them too).
    assert torch.equal((tiny * 1.0).view(torch.int32), tiny.view(torch.int32))


@needs_kernels
@pytest.mark.parametrize("threads", [2], indirect=True)
def test_prefill_kernel_spreads_over_threads(threads: int) -> None:
    gen = torch.Generator().manual_seed(10)
    seqs, num_blocks = make_seqs([(0, 200), (70, 150)], 2, 32, 16, gen)
    run_step(seqs, 4, 16, num_blocks, is_prefill=True, gen=gen)


@needs_kernels
@pytest.mark.parametrize(
    "q_shape,kv_shape,dtype,message",
    [
        ((5, 4, 32), (4, 2, 32), torch.float32, "shorter than the queries"),
        ((5, 4, 16), (5, 2, 16), torch.float32, "multiple of 32"),
        ((5, 4, 32), (5, 3, 32), torch.float32, "multiple of KV heads"),
        ((5, 4, 32), (5, 2, 32), torch.bfloat16, "one dtype"),
        ((5, 4, 32), (5, 2, 32), torch.float64, "unsupported dtype"),
    ],
)
def test_prefill_kernel_rejects_what_it_cannot_run(
    q_shape: tuple, kv_shape: tuple, dtype: torch.dtype, message: str
) -> None:
    ops = cpu_kernels.load()
    q = torch.randn(q_shape).to(torch.float64 if dtype == torch.float64 else torch.float32)
    k, v = torch.randn(kv_shape).to(dtype), torch.randn(kv_shape).to(dtype)
    with pytest.raises(RuntimeError, match=message):
        ops.causal_attention(q, k, v, 0.1)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("is_prefill", [True, False])
def test_shared_prefix_blocks(is_prefill: bool, kernel: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    block_size = 4
    count = 11 if is_prefill else 3
    # Three sequences whose first 3 blocks are one physical copy.
    specs = [(14, count), (12, count), (20, count)]
    seqs, num_blocks = make_seqs(specs, 2, 8, block_size, gen, shared_prefix_blocks=3)
    assert seqs[1].table[:3] == seqs[0].table[:3] == seqs[2].table[:3]
    run_step(seqs, 8, block_size, num_blocks, is_prefill=is_prefill, gen=gen, kernel=kernel)


@pytest.mark.parametrize("kernel", PATHS)
@pytest.mark.parametrize("is_prefill", [True, False])
def test_bfloat16(is_prefill: bool, kernel: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    # Decode: one context over the kernel's 128-token chunk, its rows widened a group of
    # keys at a time.
    specs = [(20, 6), (3, 2)] if is_prefill else [(20, 3), (150, 1), (37, 1 + 4)]
    seqs, num_blocks = make_seqs(specs, 2, 16, 4, gen)
    run_step(seqs, 8, 4, num_blocks, is_prefill, dtype=torch.bfloat16, gen=gen, kernel=kernel)


@needs_kernels
def test_kernel_float16() -> None:
    gen = torch.Generator().manual_seed(6)
    seqs, num_blocks = make_seqs([(20, 3), (50, 1)], 2, 16, 4, gen)
    run_step(seqs, 8, 4, num_blocks, False, dtype=torch.float16, gen=gen, kernel=True)


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 4]),
    head_dim=st.sampled_from([4, 8]),
    is_prefill=st.booleans(),
    group_tokens=st.sampled_from([None, 0, 1, 40]),
    kernel=st.sampled_from([False, None]),
    seed=st.integers(0, 2**16),
)
def test_random_steps(
    data: st.DataObject,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    is_prefill: bool,
    group_tokens: int | None,
    kernel: bool | None,
    seed: int,
) -> None:
    max_count = 24 if is_prefill else 9
    specs = data.draw(
        st.lists(st.tuples(st.integers(0, 60), st.integers(1, max_count)), min_size=1, max_size=5)
    )
    gen = torch.Generator().manual_seed(seed)
    seqs, num_blocks = make_seqs(specs, kv_heads, head_dim, block_size, gen)
    run_step(
        seqs,
        kv_heads * group,
        block_size,
        num_blocks,
        is_prefill,
        group_tokens=group_tokens,
        gen=gen,
        kernel=kernel,
    )
