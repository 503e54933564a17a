"""DecodeGraphs on the CPU: which steps run padded, at which shapes, and the same hidden
states as the eager step (the recording itself needs a GPU: --engine-device cuda runs
the HF comparisons with graphs recorded)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.decode_graphs import DecodeGraphs
from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.plan import ScheduledSeq, StepPlan

BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    return LLM("random:tiny", dtype="float32", num_kv_blocks=64, block_size=BLOCK).loaded


def _graphs(tiny, caches, max_rows=8, max_width=8) -> DecodeGraphs:
    return DecodeGraphs(tiny.model, caches, BLOCK, max_rows=max_rows, max_width=max_width)


def _seq(tokens: int, start: int, blocks: int, drafts: int = 0) -> ScheduledSeq:
    return ScheduledSeq(
        request_id=f"r{start}-{blocks}",
        token_ids=[1] * tokens,
        start_pos=start,
        block_ids=list(range(blocks)),
        sample=True,
        draft_token_ids=[1] * drafts,
        sampling_params=SamplingParams(),
        num_output_tokens=0,
        all_token_ids=[1] * (start + 1),
    )


def _caches(tiny, blocks: int = 64) -> list[torch.Tensor]:
    config = tiny.config
    shape = (2, blocks, BLOCK, config.num_key_value_heads, config.head_dim)
    return [torch.randn(shape) for _ in range(config.num_hidden_layers)]


def test_only_plain_decode_steps_that_fit_run_padded(tiny) -> None:
    graphs = _graphs(tiny, _caches(tiny), max_rows=4, max_width=3)
    assert graphs.takes(StepPlan(False, seqs=[_seq(1, 5, 2), _seq(1, 9, 3)]))
    assert not graphs.takes(StepPlan(True, seqs=[_seq(1, 5, 2)]))  # prefill
    assert not graphs.takes(StepPlan(False, seqs=[_seq(1, 5, 2), _seq(3, 9, 3, drafts=2)]))
    assert not graphs.takes(StepPlan(False, seqs=[_seq(1, 13, 4)]))  # wider than 3 blocks
    assert not graphs.takes(StepPlan(False, seqs=[_seq(1, 1, 1)] * 5))  # over 4 rows
    assert not graphs.takes(StepPlan(False))


def test_recording_needs_a_cuda_cache(tiny) -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(tiny.model, _caches(tiny), BLOCK, max_rows=4, max_width=4, capture=True)
    with pytest.raises(ValueError, match="max_rows"):
        DecodeGraphs(tiny.model, _caches(tiny), BLOCK, max_rows=0, max_width=4)


@torch.inference_mode()
def test_a_padded_step_gives_the_eager_steps_hidden_states_and_cache(tiny) -> None:
    """Three sequences padded to 4 rows and tables 8 blocks wide: the same hidden
    states and the same cache as the eager step, one shape prepared."""
    positions, tables, ids = [6, 0, 17], [[3, 9], [5], [1, 2, 7, 8, 4]], [11, 22, 33]
    caches = _caches(tiny)
    eager_caches = [c.clone() for c in caches]
    graphs = _graphs(tiny, caches)
    hidden = graphs.forward(ids, positions, tables)
    assert graphs.shapes == [(4, 8)]
    meta = AttentionMetadata.build(positions, [1, 1, 1], tables, BLOCK, False, "cpu")
    want = tiny.model(torch.tensor(ids), meta.positions, eager_caches, meta)
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # Fewer sequences reuse the shape: the next power of two.
    graphs.forward(ids[:2], positions[:2], tables[:2])
    graphs.forward(ids[:1], positions[:1], tables[:1])
    assert graphs.shapes == [(1, 2), (2, 2), (4, 8)]
