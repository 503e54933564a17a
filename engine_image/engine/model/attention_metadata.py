"""AttentionMetadata: everything a step's attention needs, computed once per step.

Each layer's cache is one tensor kv[2, num_blocks, block_size, num_kv_heads, head_dim]
(0 = K, 1 = V); a sequence's KV for position p lives at
block_table[p // block_size], offset p % block_size. The runner builds one
AttentionMetadata per step from the scheduler's block tables; every index and
mask the kernels (attention.py) need is computed here, so per-layer work is
tensor math only. Which decode path a step takes is decided here too:
`paged` for the C++ CPU kernel, `decode` (groups of similar context length)
for the torch path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tandem.engine.model import cpu_kernels
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.model.padded_attention import PaddedDecode

# Gathered KV bytes per decode group that decode_group_tokens() aims for on CPU. Measured
# (2 cores, batch 64 x ~512 context, 1B/8B/0.5B head shapes, fp32 and bf16): ~4 MiB groups
# are at or near the best everywhere, 2-3x faster than one batch-wide gather (page faults
# and cache misses on a >100 MiB temporary) and than a per-sequence loop (op overhead).
CPU_GROUP_BYTES = 4 << 20
# Padded context tokens per group when the caller gives no budget: 4 MiB at 2 KiB/token,
# within ~30% of the best for KV sizes from 0.5 to 8 KiB/token.
CPU_GROUP_TOKENS = 2048


def decode_group_tokens(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> int:
    """A group_tokens value for AttentionMetadata.build tuned to this model's KV size."""
    if torch.device(device).type != "cpu":
        return 0
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_key_value_heads * config.head_dim * elem
    return max(1, CPU_GROUP_BYTES // per_token)


@dataclass(frozen=True, slots=True)
class DraftTail:
    """A group's later drafts: row i of a sequence's n sits at position c - n + i and
    reads up to it, so its last n - 1 positions are each hidden from the rows before
    them. Their K stays in the gathered copy (hidden scores are set to -inf by index);
    their V is zeroed there and added back to the rows that read it."""

    # [num_seqs, 1] the group's sequence of each entry (an index, broadcast).
    seq: torch.Tensor
    # [num_seqs, max_query - 1] positions c - n + 1 .. c - 1 of each sequence, padded with
    # 0 where it verifies fewer drafts (DecodeBatch.draft_visible hides those).
    positions: torch.Tensor
    # (sequence in the group, position, query row) triples, one per draft and row it is
    # hidden from, as three index tensors.
    hidden: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    # The drafts' V in the gathered copy (index l * num_seqs + s), zeroed.
    value_index: torch.Tensor


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Sequences first:first+num_seqs of the decode batch, padded to the longest context."""

    first: int
    num_seqs: int
    max_context: int
    # [max_context * num_seqs] cache slots, position-major (slot of position l, seq s at
    # l * num_seqs + s) so the gathered K/V views as [L, seqs * kv_heads, D] for bmm.
    gather_index: torch.Tensor
    # [num_seqs, 1, max_context, 1, max_query] float32 0/-inf (causal and padding), a view
    # into one batch-wide tensor; None when the group masks nothing.
    bias: torch.Tensor | None
    # Positions past each sequence's end, zeroed in the gathered K/V (index l * num_seqs
    # + s, position-major as gather_index): the slots hold other requests' or stale K/V,
    # and a zero weight or a -inf bias meeting a non-finite one is NaN. None when none.
    zero_index: torch.Tensor | None = None
    # The group's later drafts, None when it verifies none.
    drafts: DraftTail | None = None


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """A decode step's sequences, sorted longest first and split into groups.

    Query rows are padded to max_query per sequence (padded rows repeat the sequence's
    last row and are dropped), so q and the output move in one op for all groups.
    """

    max_query: int
    # [num_seqs * max_query] flat q rows, in sorted sequence order.
    q_index: torch.Tensor
    # [T] for each flat row, its row in the padded sorted result.
    out_index: torch.Tensor
    groups: tuple[DecodeGroup, ...]
    # [num_seqs, max_query, max_query - 1] bool, sorted order: query row i reads draft t
    # (the row at q_index[s * max_query + t + 1]): t < i, and t one of its own. None
    # without drafts.
    draft_visible: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class PagedDecode:
    """A decode step as the C++ kernel reads it: sequences in batch order, nothing gathered."""

    # [num_seqs, max_blocks] int32 block tables, padded with block 0 (never read).
    block_tables: torch.Tensor
    # [num_seqs] int32 context length of each sequence after this step.
    context_lens: torch.Tensor
    # [num_seqs + 1] int32 first flat row of each sequence (and the total).
    query_start: torch.Tensor


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One sequence's prefill chunk: rows begin:end of the flat batch."""

    begin: int
    end: int
    # [context] cache slots of the whole context, or None when nothing is cached before it.
    gather_index: torch.Tensor | None
    # [chunk, context] bool, True = attend; None with gather_index.
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything the attention kernels need for one step, built once per step."""

    is_prefill: bool
    # [T] position of every flat row (RoPE reads it).
    positions: torch.Tensor
    # [T] cache slot (block * block_size + offset) each row's K/V is written to.
    slot_mapping: torch.Tensor
    # Set for decode steps on the torch path.
    decode: DecodeBatch | None
    # Set for prefill steps.
    prefill_seqs: tuple[PrefillSeq, ...]
    # Set for decode steps on the C++ kernel path (decode is None then).
    paged: PagedDecode | None = None
    # Set for decode steps at a CUDA graph's fixed shape (decode_graphs.py builds these).
    padded: PaddedDecode | None = None

    @property
    def total_tokens(self) -> int:
        return self.positions.shape[0]

    @classmethod
    def build(
        cls,
        start_positions: list[int],
        num_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        is_prefill: bool,
        device: torch.device | str,
        group_tokens: int | None = None,
        kernel: bool | None = None,
    ) -> AttentionMetadata:
        """Metadata for a step feeding num_tokens[i] tokens from start_positions[i] on.

        group_tokens caps a decode group's padded context tokens (0: no cap); None picks
        CPU_GROUP_TOKENS on CPU and no cap elsewhere (see decode_group_tokens()).
        kernel picks the decode path: True the C++ kernel (an error if it is unavailable),
        False the torch path, None the kernel when on CPU and cpu_kernels.load() built it.
        """
        _check_inputs(start_positions, num_tokens, block_tables, block_size)
        device = torch.device(device)
        if group_tokens is None:
            group_tokens = CPU_GROUP_TOKENS if device.type == "cpu" else 0
        # Index math on CPU, then one copy of each result to the device. The rows'
        # positions and slots as Python ranges, one per block a sequence's rows reach: a
        # decode step's dozen small torch ops for them took ~1 ms (its KV reads leave the
        # caches cold), the ranges ~0.3.
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        context_lens = [s + n for s, n in zip(start_positions, num_tokens, strict=True)]
        row_starts = [0, *itertools.accumulate(num_tokens)]
        positions: list[int] = []
        slots: list[int] = []
        for table, pos, end in zip(block_tables, start_positions, context_lens, strict=True):
            positions.extend(range(pos, end))
            while pos < end:
                block, offset = divmod(pos, block_size)
                run = min(end - pos, block_size - offset)
                first = table[block] * block_size + offset
                slots.extend(range(first, first + run))
                pos += run
        decode = paged = None
        prefills: tuple[PrefillSeq, ...] = ()
        if is_prefill:
            tables = torch.tensor(padded, dtype=torch.long)
            prefills = tuple(
                _prefill_seq(i, tables, start_positions, num_tokens, row_starts, block_size, device)
                for i in range(len(num_tokens))
            )
        elif _use_kernel(kernel, device):
            paged = PagedDecode(
                block_tables=torch.tensor(padded, dtype=torch.int32),
                context_lens=torch.tensor(context_lens, dtype=torch.int32),
                query_start=torch.tensor(row_starts, dtype=torch.int32),
            )
        else:
            tables = torch.tensor(padded, dtype=torch.long)
            decode = _decode_batch(
                start_positions, num_tokens, tables, block_size, group_tokens, device
            )
        return cls(
            is_prefill=is_prefill,
            positions=torch.tensor(positions, dtype=torch.long).to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device),
            decode=decode,
            prefill_seqs=prefills,
            paged=paged,
        )


def _use_kernel(kernel: bool | None, device: torch.device) -> bool:
    if kernel is False:
        return False
    if device.type != "cpu":
        if kernel:
            raise ValueError(f"the C++ decode kernel runs on CPU, not {device}")
        return False
    available = cpu_kernels.load() is not None
    if kernel and not available:
        raise ValueError("the C++ decode kernel was asked for, but cpu_kernels.load() failed")
    return available


def _check_inputs(
    start_positions: list[int],
    num_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> None:
    if not num_tokens:
        raise ValueError("attention metadata for an empty batch")
    if len(start_positions) != len(num_tokens) or len(block_tables) != len(num_tokens):
        raise ValueError(
            f"attention metadata: {len(start_positions)} start positions, {len(num_tokens)} "
            f"token counts and {len(block_tables)} block tables; they must match"
        )
    if block_size < 1:
        raise ValueError(f"attention metadata: block_size must be >= 1, got {block_size}")
    for i, (start, count, table) in enumerate(
        zip(start_positions, num_tokens, block_tables, strict=True)
    ):
        if count < 1 or start < 0:
            raise ValueError(
                f"sequence {i}: needs num_tokens >= 1 and start >= 0, got {count}, {start}"
            )
        needed = -(-(start + count) // block_size)
        if len(table) < needed:
            raise ValueError(
                f"sequence {i}: positions up to {start + count - 1} need {needed} blocks "
                f"of {block_size}, its block table has {len(table)}"
            )


def _group_by_length(sorted_lens: list[int], group_tokens: int) -> list[tuple[int, int]]:
    """(first, count) runs of the descending lengths whose padded size stays in budget."""
    groups: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(sorted_lens) + 1):
        # Descending: a group's first member is its longest.
        full = group_tokens and (i - first + 1) * sorted_lens[first] > group_tokens
        if i == len(sorted_lens) or full:
            groups.append((first, i - first))
            first = i
    return groups


def _decode_batch(
    start_positions: list[int],
    num_tokens: list[int],
    tables: torch.Tensor,
    block_size: int,
    group_tokens: int,
    device: torch.device,
) -> DecodeBatch:
    context_lens = [s + n for s, n in zip(start_positions, num_tokens, strict=True)]
    # Longest first, so a group pads little.
    order_list = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    sorted_lens = [context_lens[i] for i in order_list]
    order = torch.tensor(order_list, dtype=torch.long)
    counts = torch.tensor(num_tokens, dtype=torch.long)
    row_starts = torch.cumsum(counts, 0) - counts
    max_query, longest = max(num_tokens), sorted_lens[0]

    query = torch.arange(max_query)
    sorted_counts = counts[order]
    clamped = torch.minimum(query[None, :], sorted_counts[:, None] - 1)
    q_index = (row_starts[order][:, None] + clamped).reshape(-1)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    seq_of_row = torch.repeat_interleave(torch.arange(len(order)), counts)
    out_index = (
        rank[seq_of_row] * max_query + torch.arange(len(seq_of_row)) - row_starts[seq_of_row]
    )

    runs = _group_by_length(sorted_lens, group_tokens)
    # A group pads when its contexts differ (longest first: its last is its shortest),
    # verifies drafts when a sequence feeds more than one row, and hides positions from
    # some rows when it does either.
    pads = [sorted_lens[f + n - 1] != sorted_lens[f] for f, n in runs]
    sorted_rows = sorted_counts.tolist()
    verifies = [max(sorted_rows[f : f + n]) > 1 for f, n in runs]
    ctx = torch.arange(longest)
    bias = past_end = None
    if any(pads) or any(verifies):
        q_pos = torch.tensor(start_positions)[order][:, None] + clamped
        hidden = ctx[None, :, None] > q_pos[:, None, :]  # [seqs, L, max_query]
        bias = torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf")).to(device)
    if any(pads):
        past_end = ctx[:, None] >= torch.tensor(sorted_lens)[None, :]  # [L, seqs]
    tails = _DraftTails(sorted_lens, sorted_counts) if any(verifies) else None
    # Moved whole, then sliced per group on the device.
    slots = (tables[order][:, ctx // block_size] * block_size + ctx % block_size).to(device)
    groups = []
    for (first, n), group_pads, group_drafts in zip(runs, pads, verifies, strict=True):
        length, seqs = sorted_lens[first], slice(first, first + n)
        group_bias = zero_index = group_tail = None
        if bias is not None and (group_pads or group_drafts):
            group_bias = bias[seqs, None, :length, None, :]
        if past_end is not None and group_pads:
            zero_index = past_end[:length, seqs].flatten().nonzero().flatten().to(device)
        if tails is not None and group_drafts:
            group_tail = tails.group(first, n, device)
        groups.append(
            DecodeGroup(
                first=first,
                num_seqs=n,
                max_context=length,
                gather_index=slots[seqs, :length].t().reshape(-1),
                bias=group_bias,
                zero_index=zero_index,
                drafts=group_tail,
            )
        )
    visible = tails.visible.to(device) if tails is not None else None
    return DecodeBatch(max_query, q_index.to(device), out_index.to(device), tuple(groups), visible)


class _DraftTails:
    """The batch's later drafts, in sorted order, computed once and cut per group."""

    def __init__(self, sorted_lens: list[int], sorted_counts: torch.Tensor) -> None:
        drafted = int(sorted_counts.max()) - 1
        entry = torch.arange(drafted)[None, :]
        real = entry < sorted_counts[:, None] - 1  # [seqs, T]
        first = torch.tensor(sorted_lens)[:, None] - sorted_counts[:, None] + 1
        self.positions = torch.where(real, first + entry, 0)
        row = torch.arange(drafted + 1)[:, None]
        self.visible = (entry < row)[None] & real[:, None, :]  # [seqs, max_query, T]
        # Draft t is hidden from row i when i <= t (a real draft; so a real row too).
        self.hidden_seq, self.hidden_row, t = (real[:, None, :] & ~self.visible).nonzero().unbind(1)
        self.hidden_position = self.positions[self.hidden_seq, t]
        self.real_seq, t = real.nonzero().unbind(1)
        self.real_position = self.positions[self.real_seq, t]
        # Where each sequence's entries begin in the hidden and real lists (sorted by seq).
        self.hidden_start = _starts(self.hidden_seq, len(sorted_lens))
        self.real_start = _starts(self.real_seq, len(sorted_lens))

    def group(self, first: int, n: int, device: torch.device) -> DraftTail:
        hidden = slice(self.hidden_start[first], self.hidden_start[first + n])
        real = slice(self.real_start[first], self.real_start[first + n])
        return DraftTail(
            seq=torch.arange(n, device=device)[:, None],
            positions=self.positions[first : first + n].to(device),
            hidden=(
                (self.hidden_seq[hidden] - first).to(device),
                self.hidden_position[hidden].to(device),
                self.hidden_row[hidden].to(device),
            ),
            value_index=(self.real_position[real] * n + self.real_seq[real] - first).to(device),
        )


def _starts(seq: torch.Tensor, seqs: int) -> list[int]:
    """For sorted sequence ids, where each of 0..seqs (and the end) begins."""
    return torch.searchsorted(seq, torch.arange(seqs + 1)).tolist()


def _prefill_seq(
    i: int,
    tables: torch.Tensor,
    start_positions: list[int],
    num_tokens: list[int],
    row_starts: list[int],
    block_size: int,
    device: torch.device,
) -> PrefillSeq:
    begin = row_starts[i]
    start, count = start_positions[i], num_tokens[i]
    if start == 0:
        return PrefillSeq(begin, begin + count, None, None)
    ctx = torch.arange(start + count)
    slots = tables[i, ctx // block_size] * block_size + ctx % block_size
    mask = ctx[None, :] <= (start + torch.arange(count))[:, None]
    return PrefillSeq(begin, begin + count, slots.to(device), mask.to(device))
