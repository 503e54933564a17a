"""Microbenchmark: paged_attention's decode and prefill paths against plain SDPA.

    .venv/bin/python bench/attention_kernels.py [--threads 2] [--batch 64] [--context 512]
        [--prefill 1024] [--only decode|prefill] [--sharpness 1]

Decode: the C++ kernel (cpu_kernels.py; "n/a" where it does not build) against the
torch path (build(kernel=False), grouped gathers with the decode_group_tokens()
budget) and a baseline: the same paged context gathered into a padded
[B, L, KVH, D] batch, then one torch SDPA call (4-D, bool padding mask, enable_gqa).
Both paged paths also write the step's K/V into the cache, as they do in the model.
Prefill ("ours": the C++ prefill kernel, over the context gathered from the cache
when some of it was cached) against SDPA on contiguous tensors with is_causal, i.e.
attention with no paging at all; in float32 where the CPU has AMX, also both C++
prefill kernels on those tensors: on the tiles (split_attention.cpp, which "ours"
takes there) and on the FMA units (prefill_attention.cpp). Times are the minimum over
interleaved rounds (the CPU may be shared). --sharpness S multiplies the queries by S:
scores spread S times as far; at S ~600 they lie hundreds apart, as a very sharp head's
do, and the softmax's products fall under float32's normal range (2^-126): the case for
denormal arithmetic.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from counts import count  # bench/ is on sys.path when run as a script

from tandem.engine.model import cpu_kernels
from tandem.engine.model.attention import paged_attention
from tandem.engine.model.attention_metadata import AttentionMetadata, decode_group_tokens
from tandem.engine.model.model_config import ModelConfig

BLOCK_SIZE = 16
# (name, heads, kv_heads, head_dim)
SHAPES = [
    ("smollm2-135m", 9, 3, 64),
    ("llama-3.2-1b", 32, 8, 64),
    ("llama-3-8b", 32, 8, 128),
]


def fastest_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Round-robin over the variants so background load hits them alike; min per variant."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: t * 1e3 for name, t in best.items()}


def scattered_tables(lengths: list[int], gen: torch.Generator) -> tuple[list[list[int]], int]:
    needs = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(needs) + 1
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    return [[pool.pop() for _ in range(n)] for n in needs], num_blocks


def bench_decode(
    shape: tuple[str, int, int, int],
    dtype: torch.dtype,
    batch: int,
    context: int,
    drafts: int,
    rounds: int,
    sharpness: float = 1.0,
) -> dict[str, float]:
    _, heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    spread = context // 8
    lengths = torch.randint(context - spread, context + spread + 1, (batch,), generator=gen)
    lengths = lengths.tolist()
    tables, num_blocks = scattered_tables(lengths, gen)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    rows = 1 + drafts
    starts = [n - rows for n in lengths]
    config = ModelConfig(
        vocab_size=1,
        hidden_size=heads * head_dim,
        intermediate_size=1,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    budget = decode_group_tokens(config, dtype, "cpu")

    def build(kernel: bool) -> AttentionMetadata:
        return AttentionMetadata.build(
            starts, [rows] * batch, tables, BLOCK_SIZE, False, "cpu", budget, kernel=kernel
        )

    torch_meta = build(False)
    q = (torch.randn(batch * rows, heads, head_dim, generator=gen) * sharpness).to(dtype)
    k = torch.randn(batch * rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn_like(k)
    scale = head_dim**-0.5

    # Baseline inputs: the same slots, padded to the longest context.
    longest = max(lengths)
    pos = torch.arange(longest)
    slots = torch.stack(
        [torch.tensor(t + [0] * (-(-longest // BLOCK_SIZE) - len(t))) for t in tables]
    )
    padded = (slots[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    q_pos = torch.tensor(starts)[:, None] + torch.arange(rows)
    mask = (pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, rows, L]
    flat = cache.view(2, -1, kv_heads, head_dim)

    def sdpa() -> torch.Tensor:
        kv = flat.index_select(1, padded).view(2, batch, longest, kv_heads, head_dim)
        qb = q.view(batch, rows, heads, head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(
            qb, kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=mask, enable_gqa=True
        )

    fns = {
        "torch": lambda: paged_attention(q, k, v, cache, torch_meta, scale),
        "sdpa": sdpa,
        "build torch": lambda: build(False),
    }
    if cpu_kernels.load() is not None:
        kernel_meta = build(True)
        fns["kernel"] = lambda: paged_attention(q, k, v, cache, kernel_meta, scale)
        fns["build kernel"] = lambda: build(True)
    return fastest_ms(fns, rounds)


def bench_prefill(
    shape: tuple[str, int, int, int],
    dtype: torch.dtype,
    tokens: int,
    cached: int,
    rounds: int,
    sharpness: float = 1.0,
) -> dict[str, float]:
    _, heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(1)
    total = cached + tokens
    tables, num_blocks = scattered_tables([total], gen)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build([cached], [tokens], tables, BLOCK_SIZE, True, "cpu")
    q = (torch.randn(tokens, heads, head_dim, generator=gen) * sharpness).to(dtype)
    k_all = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v_all = torch.randn_like(k_all)
    k, v = k_all[cached:], v_all[cached:]
    scale = head_dim**-0.5
    causal = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]

    def sdpa() -> torch.Tensor:
        # Unpaged: K/V already contiguous in [1, KVH, L, D], nothing gathered or written.
        return F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k_all.transpose(0, 1)[None],
            v_all.transpose(0, 1)[None],
            is_causal=cached == 0,
            attn_mask=None if cached == 0 else causal,
            enable_gqa=True,
        )

    def ours() -> torch.Tensor:
        return paged_attention(q, k, v, cache, meta, scale)

    fns = {"ours": ours, "sdpa": sdpa}
    ops = cpu_kernels.load()
    if dtype == torch.float32 and ops is not None and ops.amx_ready() and head_dim % 32 == 0:
        # Both C++ prefill kernels on the same unpaged K/V: AMX tiles against FMA units.
        fns["tiles"] = lambda: ops.split_causal_attention(q, k_all, v_all, scale)
        fns["fma"] = lambda: ops.causal_attention(q, k_all, v_all, scale)
    return fastest_ms(fns, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--rounds", type=count, default=7)
    parser.add_argument("--only", choices=("decode", "prefill"), help="run one kind of case")
    parser.add_argument("--sharpness", type=float, default=1.0, help="queries times this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, block {BLOCK_SIZE},"
        f" queries x{args.sharpness:g}"
    )
    print("decode: kernel and torch paths, SDPA baseline, metadata build() per step")
    print(
        f"{'case':54s} {'kernel':>8s} {'torch':>8s} {'sdpa':>8s} {'sdpa/kern':>9s}"
        f" {'build k':>8s} {'build t':>8s}   (ms)"
    )
    for shape in SHAPES:
        name, heads, kv_heads, head_dim = shape
        tag = f"{name} {heads}h/{kv_heads}kv/d{head_dim}"
        for dtype in (torch.float32, torch.bfloat16):
            dt = str(dtype).removeprefix("torch.")
            for drafts in (0, 4) if args.only != "prefill" else ():
                t = bench_decode(
                    shape, dtype, args.batch, args.context, drafts, args.rounds, args.sharpness
                )
                case = f"{tag} decode b{args.batch}x~{args.context} +{drafts}d {dt}"
                kernel = t.get("kernel", float("nan"))
                print(
                    f"{case:54s} {kernel:8.2f} {t['torch']:8.2f} {t['sdpa']:8.2f} "
                    f"{t['sdpa'] / kernel:9.2f} {t.get('build kernel', float('nan')):8.2f} "
                    f"{t['build torch']:8.2f}"
                )
        for dtype in (torch.float32, torch.bfloat16):
            dt = str(dtype).removeprefix("torch.")
            for cached in (0, args.prefill // 2) if args.only != "decode" else ():
                new = args.prefill - cached
                t = bench_prefill(shape, dtype, new, cached, args.rounds, args.sharpness)
                case = f"{tag} prefill {new} after {cached} {dt}"
                ratio = t["sdpa"] / t["ours"]
                line = f"{case:54s} ours {t['ours']:8.2f} sdpa {t['sdpa']:8.2f} ratio {ratio:.2f}"
                if "tiles" in t:
                    line += (
                        f"   tiles {t['tiles']:7.2f} fma {t['fma']:7.2f}"
                        f" fma/tiles {t['fma'] / t['tiles']:.2f}"
                    )
                print(line)


if __name__ == "__main__":
    main()
