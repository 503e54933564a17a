"""paged_attention against dense causal attention computed from unpaged K/V: what holds
on prefill and decode steps alike (each phase's own tests: test_attention_decode.py,
test_attention_prefill.py; the step they all check: paged_attention_check.py).

Decode steps run on both paths: the C++ kernel (cpu_kernels.py; skipped where it
cannot be built) and the pure-torch fallback, forced with build(kernel=False).
Prefill takes the C++ kernel for head dims that are multiples of 32, SDPA
otherwise; tests force SDPA by making cpu_kernels.load() return None.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.kernels import needs_kernels
from tests.engine.paged_attention_check import PATHS, make_seqs, run_step


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
