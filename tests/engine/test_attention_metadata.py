"""AttentionMetadata.build: the slots, groups, draft masks and kernel tables a step's
attention reads (attention_metadata.py), and the KV cache's allocation."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.attention import allocate_kv_cache
from tandem.engine.model.attention_metadata import AttentionMetadata, decode_group_tokens
from tandem.engine.model.model_config import ModelConfig
from tests.engine.kernels import needs_kernels


def test_decode_groups_split_by_budget() -> None:
    meta = AttentionMetadata.build(
        [10, 99, 30, 31],
        [1, 1, 1, 1],
        [[0] * 7] * 4,
        16,
        False,
        "cpu",
        group_tokens=70,
        kernel=False,
    )
    assert meta.decode is not None
    groups = meta.decode.groups
    # Longest first; 100 tokens alone, then 32 + 31 padded to 2 * 32, then 11.
    assert [(g.first, g.num_seqs) for g in groups] == [(0, 1), (1, 2), (3, 1)]
    assert [g.max_context for g in groups] == [100, 32, 11]
    # Nothing to hide: one query each, and no padding in the single-sequence groups.
    assert all(g.bias is None and g.zero_index is None for g in (groups[0], groups[2]))
    assert groups[1].bias is not None and groups[1].zero_index is not None
    assert groups[1].zero_index.tolist() == [31 * 2 + 1]  # position 31 of the second
    assert not any(g.drafts for g in groups) and meta.decode.draft_visible is None
    # Sequence 3 (rows at 31 and 32, sorted second) verifies the only draft, at 32: its
    # score is set to -inf for the first row, and its V zeroed in the gathered copy and
    # read by the second row only. The gathered K/V past each end are zeroed.
    unlimited = AttentionMetadata.build(
        [10, 99, 30, 31],
        [1, 1, 1, 2],
        [[0] * 7] * 4,
        16,
        False,
        "cpu",
        group_tokens=0,
        kernel=False,
    )
    decode = unlimited.decode
    assert decode is not None and len(decode.groups) == 1
    (group,) = decode.groups
    assert group.drafts is not None and group.zero_index is not None
    assert group.drafts.positions.tolist() == [[0], [32], [0], [0]]
    assert [t.tolist() for t in group.drafts.hidden] == [[1], [32], [0]]
    assert group.drafts.value_index.tolist() == [32 * 4 + 1]
    assert decode.draft_visible is not None
    assert (
        decode.draft_visible.tolist()
        == [[[False], [False]], [[False], [True]]] + [[[False], [False]]] * 2
    )
    zeroed = {(int(i) // 4, int(i) % 4) for i in group.zero_index}  # (position, seq)
    assert {p for p, s in zeroed if s == 0} == set()
    assert {p for p, s in zeroed if s == 1} == set(range(33, 100))
    assert {p for p, s in zeroed if s == 3} == set(range(11, 100))


def test_decode_metadata_hides_each_draft_from_the_rows_before_it() -> None:
    # Sequence 0 feeds rows at 10, 11 and 12 (two drafts, at 11 and 12); sequence 1 one
    # row at 4. One group, padded to 13 positions.
    meta = AttentionMetadata.build(
        [10, 4], [3, 1], [[0] * 4] * 2, 4, False, "cpu", group_tokens=0, kernel=False
    )
    decode = meta.decode
    assert decode is not None and decode.draft_visible is not None
    (group,) = decode.groups
    drafts = group.drafts
    assert drafts is not None and group.zero_index is not None
    assert drafts.positions.tolist() == [[11, 12], [0, 0]]  # 1 has none: padding
    # (sequence, position, row): 11 hidden from row 0, 12 from rows 0 and 1.
    assert [t.tolist() for t in drafts.hidden] == [[0, 0, 0], [11, 12, 12], [0, 0, 1]]
    assert drafts.value_index.tolist() == [11 * 2 + 0, 12 * 2 + 0]
    visible = [[[False, False], [True, False], [True, True]], [[False, False]] * 3]
    assert decode.draft_visible.tolist() == visible
    assert group.zero_index.tolist() == [p * 2 + 1 for p in range(5, 13)]


def test_slot_mapping() -> None:
    meta = AttentionMetadata.build([5, 0], [3, 2], [[7, 2], [4]], 4, True, "cpu")
    assert meta.positions.tolist() == [5, 6, 7, 0, 1]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 16, 17]
    # Rows across block boundaries: positions 3..8 in blocks 9, 1, 5 of 4 slots.
    meta = AttentionMetadata.build([3], [6], [[9, 1, 5]], 4, True, "cpu")
    assert meta.slot_mapping.tolist() == [39, 4, 5, 6, 7, 20]


@pytest.mark.parametrize(
    "args,message",
    [
        (([0], [1, 1], [[0], [0]], 4, False), "must match"),
        (([6], [3], [[0, 1]], 4, False), "need 3 blocks"),
        (([0], [0], [[0]], 4, True), "num_tokens >= 1"),
        (([], [], [], 4, True), "empty batch"),
        (([0], [1], [[0]], 0, True), "block_size"),
    ],
)
def test_build_rejects_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(*args, device="cpu")


def test_allocate_kv_cache() -> None:
    config = ModelConfig(
        vocab_size=10,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    caches = allocate_kv_cache(config, 5, 16, torch.bfloat16, "cpu")
    assert len(caches) == 3
    assert caches[0].shape == (2, 5, 16, 2, 8) and caches[0].dtype == torch.bfloat16
    assert not caches[0].any()
    assert decode_group_tokens(config, torch.float32, "cpu") > 0
    assert decode_group_tokens(config, torch.float32, "meta") == 0
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_cache(config, 0, 16, torch.float32, "cpu")


@needs_kernels
def test_kernel_metadata() -> None:
    meta = AttentionMetadata.build(
        [10, 99, 30], [1, 3, 2], [[5, 1], [0] * 7, [2, 3]], 16, False, "cpu"
    )
    assert meta.decode is None and meta.paged is not None
    p = meta.paged
    assert p.block_tables.dtype == p.context_lens.dtype == p.query_start.dtype == torch.int32
    assert p.block_tables.tolist() == [[5, 1] + [0] * 5, [0] * 7, [2, 3] + [0] * 5]
    assert p.context_lens.tolist() == [11, 102, 32]
    assert p.query_start.tolist() == [0, 1, 4, 6]
    prefill = AttentionMetadata.build([0], [5], [[0]], 16, True, "cpu")
    assert prefill.paged is None  # prefill runs SDPA
    with pytest.raises(ValueError, match="runs on CPU"):
        AttentionMetadata.build([0], [1], [[0]], 16, False, "meta", kernel=True)
