"""Paged attention: the KV cache and the kernels (metadata: attention_metadata.py).

Each layer's cache is one tensor kv[2, num_blocks, block_size, num_kv_heads, head_dim]
(0 = K, 1 = V); a sequence's KV for position p lives at
block_table[p // block_size], offset p % block_size.

The runner builds one AttentionMetadata per step; every index and mask the
kernels need is computed there once, so per-layer work is tensor math only.

Paths, chosen by the step kind:
- decode on CPU, when the C++ kernels built (cpu_kernels.load()): one fused call
  per layer writes the step's K/V into the cache and attends straight from the
  paged cache through each sequence's block table (no gathered copy), GQA query
  heads sharing each K/V read, drafts masked causally, softmax in float32.
- decode otherwise (accelerators, or the kernels unavailable / disabled with
  TANDEM_CPU_KERNELS=0 / build(kernel=False)): sequences are sorted by context
  length and batched in groups; each group gathers its context from the cache and
  runs two grouped batched matmuls (no KV-head expansion; a third, small, for
  drafts). Groups are sized so the gathered KV stays cache-resident on CPU; on
  accelerators one group holds all.
  What a row must not read it reads as nothing, as the kernel does, even where the
  K/V are not finite (another request's, a stale slot's, an overflowed draft's: a
  zero weight times inf is NaN, and so is -inf plus inf): the gathered copy is
  zeroed past each sequence's end; a later draft's scores are set to -inf for the
  rows before it, and its V, zeroed there, is added back only to the rows that
  read it.
- decode at a CUDA graph's fixed shape (padded_attention.py): the batch padded to
  the graph's rows, block tables to its width, lengths read from a tensor.
- prefill on CPU with head_dim a multiple of 32, when the C++ kernels built: one
  kernel call per sequence, the chunk's queries against its own K/V, or against the
  whole context gathered from the cache after cached tokens: float32 on AMX tiles
  (csrc/split_attention.cpp) for SPLIT_ATTENTION_QUERIES queries or more where the
  CPU has them, else causal_attention (csrc/prefill_attention.cpp) on the FMA units.
- prefill otherwise (any chunk length): torch SDPA per sequence (flash kernels where
  they apply), is_causal when there is no cached prefix, an explicit mask when there is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.host_memory import advise_huge_pages
from tandem.engine.model import cpu_kernels
from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.model.decode_batch import DraftTail
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.model.padded_attention import padded_decode_attention

# The C++ prefill kernel's register tiles are 32 floats wide (csrc/prefill_attention.cpp).
PREFILL_HEAD_DIM_MULTIPLE = 32
# A sequence's queries from which float32 prefill attention on AMX tiles
# (csrc/split_attention.cpp) beats the FMA kernel: 1.1x at 32 (1.2-1.3x from 64), 0.76x
# at 16, where most of its 32-row tiles would be padding (docs/benchmarks.md).
SPLIT_ATTENTION_QUERIES = 32


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One kv[2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer.

    Zero-filled, not empty: no path reads a slot before it is written (the kernels
    stop at each sequence's context, the torch path zeroes what it gathers past it),
    but a pool of defined values keeps any stray read finite, and the memory is
    committed now rather than at some later step. On the CPU, asked onto huge pages
    before the zeros touch it (host_memory.advise_huge_pages).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
        )
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    caches = []
    for _ in range(config.num_hidden_layers):
        cache = torch.empty(shape, dtype=dtype, device=device)
        if cache.device.type == "cpu":
            advise_huge_pages(cache.data_ptr(), cache.numel() * cache.element_size())
        caches.append(cache.zero_())
    return caches


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write k/v [T, KVH, D] into the cache, then attend q [T, H, D]; returns [T, H, D]."""
    if meta.padded is not None:
        slots = meta.slot_mapping
        return padded_decode_attention(q, k, v, kv_cache_layer, slots, meta.padded, scale)
    if meta.paged is not None:
        p = meta.paged
        # Registered: the metadata takes the kernel path only once cpu_kernels.load()
        # built it (and not asking again spares 30 environment reads a step).
        return torch.ops.tandem_cpu.paged_decode_attention(
            _dense_heads(q),
            _dense_heads(k),
            _dense_heads(v),
            kv_cache_layer,
            meta.slot_mapping,
            p.block_tables,
            p.context_lens,
            p.query_start,
            scale,
        )
    _, _, _, kv_heads, head_dim = kv_cache_layer.shape
    flat = kv_cache_layer.view(2, -1, kv_heads, head_dim)
    flat[0].index_copy_(0, meta.slot_mapping, k)
    flat[1].index_copy_(0, meta.slot_mapping, v)
    if meta.is_prefill:
        return _prefill(q, k, v, flat, meta, scale)
    return _decode(q, v, flat, meta, scale)


def _dense_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] as the kernel reads it: rows may be strided (views of a fused
    projection), each row's heads dense."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _decode(
    q: torch.Tensor, v: torch.Tensor, flat: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    batch = meta.decode
    if batch is None:
        raise ValueError("decode attention needs metadata built with is_prefill=False")
    heads, head_dim = q.shape[1:]
    kv_heads = flat.shape[2]
    group, nq = heads // kv_heads, batch.max_query
    seqs = batch.q_index.shape[0] // nq
    # Queries of one KV head side by side: [seqs * KVH, group * nq, D], sorted order.
    qs = (q.index_select(0, batch.q_index) * scale).view(seqs, nq, kv_heads, group, head_dim)
    qs = qs.permute(0, 2, 3, 1, 4).reshape(seqs * kv_heads, group * nq, head_dim)
    res = torch.empty_like(qs)
    visible = batch.draft_visible
    draft_values = _draft_values(v, batch.q_index, visible) if visible is not None else None
    for g in batch.groups:
        n, ctx = g.num_seqs, g.max_context
        rows = slice(g.first * kv_heads, (g.first + n) * kv_heads)
        kv = flat.index_select(1, g.gather_index)
        if g.zero_index is not None:
            kv.index_fill_(1, g.zero_index, 0)
        if g.drafts is not None:
            kv[1].index_fill_(0, g.drafts.value_index, 0)
        # [ctx, n * KVH, D]: batch index (seq, kv head) has a uniform stride, so bmm reads
        # the gathered tensor in place instead of copying it into a contiguous layout.
        kv = kv.view(2, ctx, n * kv_heads, head_dim)
        # Scores as [batch, ctx, queries] (K @ q^T): measured faster than q @ K^T for bf16.
        scores = torch.bmm(kv[0].transpose(0, 1), qs[rows].transpose(1, 2))
        if g.bias is not None:
            scores = scores.view(n, kv_heads, ctx, group, nq) + g.bias
            if g.drafts is not None:  # -inf plus a non-finite K would be NaN: set, not added
                s, p, i = g.drafts.hidden
                scores[s, :, p, :, i] = -torch.inf
            scores = scores.view(n * kv_heads, ctx, group * nq)
        probs = torch.softmax(scores, dim=1, dtype=torch.float32).to(q.dtype)
        if g.drafts is None or draft_values is None:
            torch.bmm(probs.transpose(1, 2), kv[1].transpose(0, 1), out=res[rows])
        else:  # the drafts' part first, so that the sum rounds once in 16-bit dtypes
            first, last = g.first * kv_heads * nq, (g.first + n) * kv_heads * nq
            drafted = _weighted_draft_values(probs, draft_values[first:last], g.drafts, group)
            torch.baddbmm(drafted, probs.transpose(1, 2), kv[1].transpose(0, 1), out=res[rows])
    res = res.view(seqs, kv_heads, group, nq, head_dim).permute(0, 3, 1, 2, 4)
    return res.reshape(seqs * nq, heads, head_dim).index_select(0, batch.out_index)


def _draft_values(v: torch.Tensor, q_index: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The step's drafts' V rows, one copy per query row holding only the drafts it reads
    (DecodeBatch.draft_visible; zeros elsewhere, so that a non-finite value reaches no
    row before it): [seqs * KVH * max_query, max_query - 1, D], sorted order."""
    seqs, nq, drafted = visible.shape
    kv_heads, head_dim = v.shape[1:]
    # Row t + 1 of each sequence fed draft t (a sequence's padded rows repeat its last).
    rows = v.index_select(0, q_index).view(seqs, nq, kv_heads, head_dim)[:, 1:]
    seen = visible[:, None, :, :, None]  # [seqs, 1, nq, T, 1]
    values = torch.where(seen, rows.transpose(1, 2)[:, :, None], 0)  # [seqs, KVH, nq, T, D]
    return values.reshape(seqs * kv_heads * nq, drafted, head_dim)


def _weighted_draft_values(
    probs: torch.Tensor, values: torch.Tensor, drafts: DraftTail, group: int
) -> torch.Tensor:
    """The drafts' share of each row's output, [n * KVH, group * nq, D]: _draft_values'
    rows for the group (zeroed in the gathered copy) times each row's probabilities."""
    n, drafted = drafts.positions.shape
    kv_heads, nq = probs.shape[0] // n, values.shape[0] // probs.shape[0]
    head_dim = values.shape[2]
    weights = probs.view(n, kv_heads, -1, group, nq)[drafts.seq, :, drafts.positions]
    weights = weights.permute(0, 2, 4, 3, 1).reshape(n * kv_heads * nq, group, drafted)
    added = torch.bmm(weights, values).view(n, kv_heads, nq, group, head_dim)
    return added.transpose(2, 3).reshape(n * kv_heads, group * nq, head_dim)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    flat: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    ops = _prefill_kernel(q, k, v)
    gqa = q.shape[1] != k.shape[1]
    outputs = []
    for s in meta.prefill_seqs:
        qs, ks, vs = q[s.begin : s.end], k[s.begin : s.end], v[s.begin : s.end]
        if s.gather_index is not None:  # after cached tokens: the whole context's KV
            kv = flat.index_select(1, s.gather_index)
            ks, vs = kv[0], kv[1]
        if ops is not None:
            dense = [_dense_heads(x) for x in (qs, ks, vs)]
            outputs.append(_causal_kernel(ops, qs)(*dense, scale))
            continue
        # SDPA wants [batch, heads, len, D]; 3-D inputs measured ~10x slower on CPU.
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0),
            ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0),
            is_causal=s.mask is None,
            attn_mask=s.mask,
            scale=scale,
            enable_gqa=gqa,
        )
        # [len, H, D]; the CPU and flash kernels lay it out contiguously already.
        outputs.append(o[0].transpose(0, 1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _prefill_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object | None:
    """torch.ops.tandem_cpu when the C++ prefill kernel takes q (on CPU, a dtype the kernels
    take, head_dim a multiple of 32, nothing for autograd to track) and beats SDPA, else
    None: SDPA. bfloat16 on a CPU with AMX goes to SDPA, whose flash kernel multiplies on
    the tiles where this one computes in float32: 1.3-2.5x faster on a Xeon
    (docs/benchmarks.md, "Attention kernels")."""
    if q.shape[-1] % PREFILL_HEAD_DIM_MULTIPLE:
        return None
    ops = cpu_kernels.for_tensors(q, k, v)
    if ops is not None and q.dtype == torch.bfloat16 and ops.amx_ready():
        return None
    return ops


def _causal_kernel(ops, q: torch.Tensor):
    """Which kernel takes one sequence's queries q [T, H, D]: float32 on AMX tiles
    (split_causal_attention) from SPLIT_ATTENTION_QUERIES of them where the CPU has the
    tiles, else the FMA kernel (causal_attention)."""
    if q.dtype == torch.float32 and q.shape[0] >= SPLIT_ATTENTION_QUERIES and ops.amx_ready():
        return ops.split_causal_attention
    return ops.causal_attention
