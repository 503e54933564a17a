"""Prefill attention in float32 on AMX tiles (csrc/split_attention.cpp).

Where the CPU has AMX, a float32 prefill of SPLIT_ATTENTION_QUERIES queries or more runs
split_causal_attention: q, k, the probabilities and v split exactly into three bfloat16
parts, their products summed on the tiles in float32. It keeps causal_attention's
contract, so it is held to the same float64 reference, tighter than a part left out
would allow (the terms of i + j = 2 left out: 4e-5 to 1e-4 on these inputs).
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model import attention, cpu_kernels

OPS = cpu_kernels.load()
needs_amx = pytest.mark.skipif(
    OPS is None or not OPS.amx_ready(),
    reason="needs the kernels built with AMX tiles (Xeons since Sapphire Rapids), the OS's grant",
)
# Max error against float64 on unit-variance inputs: float32's rounding of the scores, the
# exponentials and the sums (the FMA kernel's is 3e-7 to 2e-6 on the same inputs).
TOLERANCE = 2e-6


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64; query i sits at position L - T + i."""
    queries, heads, _ = q.shape
    context, kv_heads, _ = k.shape
    group = heads // kv_heads
    kd = k.double().repeat_interleave(group, 1)
    vd = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,lhd->htl", q.double(), kd) * scale
    positions = torch.arange(context - queries, context)[:, None]
    scores = scores.masked_fill(torch.arange(context)[None, :] > positions, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), vd)


def inputs(queries: int, context: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, heads, head_dim, generator=gen)
    k = torch.randn(context, kv_heads, head_dim, generator=gen)
    v = torch.randn(context, kv_heads, head_dim, generator=gen)
    return q, k, v


def max_error(out: torch.Tensor, q, k, v, scale: float) -> float:
    return (out.double() - reference(q, k, v, scale)).abs().max().item()


@needs_amx
@pytest.mark.parametrize(
    ("queries", "context", "heads", "kv_heads", "head_dim"),
    [
        (1024, 1024, 9, 3, 64),  # SmolLM2's prefill
        (37, 37, 4, 4, 32),  # no GQA; a block's rows past the queries
        (33, 33, 6, 2, 64),  # one query past a block
        (50, 300, 8, 2, 128),  # a chunk after cached tokens; head_dim 128
        (1, 65, 9, 3, 64),  # one query
        (100, 130, 4, 1, 64),  # GQA 4, a context not a whole key block
    ],
)
def test_matches_float64(
    queries: int, context: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    q, k, v = inputs(queries, context, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = OPS.split_causal_attention(q, k, v, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert max_error(out, q, k, v, scale) <= TOLERANCE


@needs_amx
@pytest.mark.parametrize("seed", range(4))
def test_scores_far_apart(seed: int) -> None:
    """Scores hundreds apart: most probabilities underflow (flushed, not denormal), the
    rest as float64 has them, within float32's rounding of scores this large (the FMA
    kernel's error: 1.2e-5 to 2.2e-5)."""
    q, k, v = inputs(96, 96, 4, 2, 64, seed)
    q *= 30
    out = OPS.split_causal_attention(q, k, v, 0.125)
    assert max_error(out, q, k, v, 0.125) <= 5e-5


@needs_amx
def test_a_rows_max_is_over_the_keys_it_sees() -> None:
    """Later keys scoring far above a row's own leave it alone: row 0 sees key 0 only, so
    its output is v[0] (a max taken over unseen keys would underflow every probability)."""
    q, k, v = inputs(40, 40, 2, 1, 64)
    k[1:] = q[0, 0] * 50  # every later key scores ~50 |q|^2 against row 0
    out = OPS.split_causal_attention(q, k, v, 0.125)
    assert torch.equal(out[0], v[0].expand(2, 64))


@needs_amx
def test_reads_strided_rows_of_a_fused_projection() -> None:
    """q, k, v as column views of one QKV product, rows strided: as dense copies."""
    qkv = torch.randn(70, (6 + 2 + 2) * 64)
    q = qkv[:, : 6 * 64].view(70, 6, 64)
    k = qkv[:, 6 * 64 : 8 * 64].view(70, 2, 64)
    v = qkv[:, 8 * 64 :].view(70, 2, 64)
    strided = OPS.split_causal_attention(q, k, v, 0.125)
    dense = OPS.split_causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert torch.equal(strided, dense)


@needs_amx
def test_threads_do_not_change_a_result() -> None:
    """Each block's rows are computed alike whichever thread takes them: bit for bit."""
    q, k, v = inputs(200, 260, 9, 3, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = OPS.split_causal_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = OPS.split_causal_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_amx
def test_no_row_reads_a_later_position() -> None:
    """Changing the K and V of position p leaves every row before p as it was, exactly."""
    q, k, v = inputs(64, 64, 4, 2, 64)
    before = OPS.split_causal_attention(q, k, v, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[40:] *= 100
    v2[40:] = -v2[40:]
    after = OPS.split_causal_attention(q, k2, v2, 0.125)
    assert torch.equal(before[:40], after[:40])
    assert not torch.equal(before[40:], after[40:])


@needs_amx
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q.bfloat16(), k.bfloat16(), v.bfloat16()), "must be float32"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48]), "each row's heads must be dense"),
        (
            lambda q, k, v: (
                q[..., :48].contiguous(),
                k[..., :48].contiguous(),
                v[..., :48].contiguous(),
            ),
            "multiple of 32",
        ),
        (lambda q, k, v: (q, k[:10], v[:10]), "shorter than the queries"),
        (lambda q, k, v: (q[:, :3], k, v), "multiple of KV heads"),
        (lambda q, k, v: (q, k, v[:, :1]), "k and v must be"),
    ],
)
def test_rejects_what_it_cannot_run(change, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        OPS.split_causal_attention(*change(*inputs(16, 16, 4, 2, 64)), 0.125)


@needs_amx
def test_prefill_takes_the_tiles_from_enough_queries_in_float32() -> None:
    def kernel(queries: int, dtype: torch.dtype = torch.float32):
        return attention._causal_kernel(OPS, torch.zeros(queries, 4, 64, dtype=dtype))

    rows = attention.SPLIT_ATTENTION_QUERIES
    assert kernel(rows) is OPS.split_causal_attention
    assert kernel(1024) is OPS.split_causal_attention
    assert kernel(rows - 1) is OPS.causal_attention  # mostly padding on the tiles
    assert kernel(1024, torch.float16) is OPS.causal_attention
