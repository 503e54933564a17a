"""paged_attention's prefill steps: the C++ prefill kernel, and SDPA where it does not apply."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model import attention, cpu_kernels
from tests.engine.kernels import needs_kernels
from tests.engine.paged_attention_check import PATHS, make_seqs, reference, run_step


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
