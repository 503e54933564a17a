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


def _graphs(tiny, caches, max_seqs=8, max_width=8, max_queries=1) -> DecodeGraphs:
    return DecodeGraphs(
        tiny.model, caches, BLOCK, max_seqs=max_seqs, max_width=max_width, max_queries=max_queries
    )


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


def test_decode_steps_that_fit_run_padded(tiny) -> None:
    graphs = _graphs(tiny, _caches(tiny), max_seqs=4, max_width=3, max_queries=3)
    assert _takes(graphs, StepPlan(False, seqs=[_seq(1, 5, 2), _seq(1, 9, 3)]))
    assert _takes(graphs, StepPlan(False, seqs=[_seq(1, 5, 2), _seq(3, 9, 3, drafts=2)]))
    assert not _takes(graphs, StepPlan(False, seqs=[_seq(4, 5, 3, drafts=3)]))  # over 3 rows
    assert not _takes(graphs, StepPlan(True, seqs=[_seq(1, 5, 2)]))  # prefill
    assert not _takes(graphs, StepPlan(False, seqs=[_seq(1, 13, 4)]))  # wider than 3 blocks
    assert not _takes(graphs, StepPlan(False, seqs=[_seq(1, 1, 1)] * 5))  # over 4 sequences
    assert not _takes(graphs, StepPlan(False))


def _takes(graphs: DecodeGraphs, plan: StepPlan) -> bool:
    return graphs.shape_for(plan) is not None


def test_shapes_that_would_gather_too_much_kv_run_op_by_op(tiny) -> None:
    config = tiny.config
    per_token = 2 * config.num_key_value_heads * config.head_dim * 4  # float32
    # Room for 4 sequences x 4 blocks of 4 tokens, not for 8 x 4 nor 4 x 8.
    graphs = DecodeGraphs(
        tiny.model,
        _caches(tiny),
        BLOCK,
        max_seqs=8,
        max_width=8,
        max_gather_bytes=4 * 4 * BLOCK * per_token,
    )
    assert graphs.shape_for(StepPlan(False, seqs=[_seq(1, 9, 3)] * 4)) == (4, 1, 4)
    assert graphs.shape_for(StepPlan(False, seqs=[_seq(1, 9, 3)] * 5)) is None
    assert graphs.shape_for(StepPlan(False, seqs=[_seq(1, 17, 5)] * 4)) is None


def test_recording_needs_a_cuda_cache(tiny) -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(tiny.model, _caches(tiny), BLOCK, max_seqs=4, max_width=4, capture=True)
    with pytest.raises(ValueError, match="max_seqs"):
        DecodeGraphs(tiny.model, _caches(tiny), BLOCK, max_seqs=0, max_width=4)


def _step(seqs: list[ScheduledSeq]) -> tuple[list[int], AttentionMetadata]:
    ids = [t for s in seqs for t in s.token_ids]
    meta = AttentionMetadata.build(
        [s.start_pos for s in seqs],
        [len(s.token_ids) for s in seqs],
        [s.block_ids for s in seqs],
        BLOCK,
        False,
        "cpu",
    )
    return ids, meta


@pytest.mark.parametrize("drafts", [0, 2])
@torch.inference_mode()
def test_a_padded_step_gives_the_eager_steps_hidden_states_and_cache(tiny, drafts) -> None:
    """Three sequences (two verifying drafts, where drafts) padded to 4 sequences of
    1 or 3 rows and tables 8 blocks wide: the same hidden states, in the step's own
    row order, and the same cache as the eager step."""
    seqs = [
        _seq(1 + drafts, 6, 3, drafts=drafts),
        _seq(1, 0, 1),
        _seq(1 + drafts, 17, 6, drafts=drafts),
    ]
    for seq, table in zip(seqs, ([3, 9, 10], [5], [1, 2, 7, 8, 4, 11]), strict=True):
        seq.block_ids = table
        seq.token_ids = [11 + 7 * i + len(table) for i in range(len(seq.token_ids))]
    caches = _caches(tiny)
    eager_caches = [c.clone() for c in caches]
    graphs = _graphs(tiny, caches, max_queries=3)
    hidden = graphs.forward(seqs, graphs.shape_for(StepPlan(False, seqs=seqs)))
    assert graphs.shapes == [(4, 1 if drafts == 0 else 3, 8)]
    ids, meta = _step(seqs)
    want = tiny.model(torch.tensor(ids), meta.positions, eager_caches, meta)
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(caches, eager_caches, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_fewer_sequences_take_smaller_shapes(tiny) -> None:
    graphs = _graphs(tiny, _caches(tiny))
    for count in (3, 2, 1, 5):
        seqs = [_seq(1, 4 * i, i + 1) for i in range(count)]
        graphs.forward(seqs, graphs.shape_for(StepPlan(False, seqs=seqs)))
    assert graphs.shapes == [(1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 8)]
