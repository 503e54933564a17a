"""One paged_attention step checked against dense float64 attention over unpaged K/V."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

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
    cache = cached_pool(seqs, block_size, num_blocks, dtype, stale, poison)
    flat = cache.view(2, -1, kv_heads, head_dim)
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
        check_written(flat, s, block_size, dtype)


def slot_of(seq: Seq, position: int, block_size: int) -> int:
    """The cache slot of a sequence's position, through its block table."""
    return seq.table[position // block_size] * block_size + position % block_size


def cached_pool(
    seqs: list[Seq],
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    stale: float = 0.0,
    poison: float | None = None,
) -> torch.Tensor:
    """A KV cache [2, blocks, block_size, KVH, D] holding each sequence's cached prefix,
    stale in every other slot; poison first replaces each sequence's last K and V row."""
    kv_heads, head_dim = seqs[0].k.shape[1:]
    if poison is not None:
        for s in seqs:
            s.k[-1], s.v[-1] = poison, poison
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), stale, dtype=dtype)
    flat = cache.view(2, -1, kv_heads, head_dim)
    for s in seqs:
        for p in range(s.start):
            flat[0, slot_of(s, p, block_size)] = s.k[p]
            flat[1, slot_of(s, p, block_size)] = s.v[p]
    return cache


def check_written(flat: torch.Tensor, seq: Seq, block_size: int, dtype: torch.dtype) -> None:
    """The step wrote exactly the sequence's new K and V rows into their slots."""
    for p in range(seq.start, seq.k.shape[0]):
        for half, values in ((0, seq.k), (1, seq.v)):
            torch.testing.assert_close(
                flat[half, slot_of(seq, p, block_size)],
                values[p].to(dtype),
                rtol=0,
                atol=0,
                equal_nan=True,
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
