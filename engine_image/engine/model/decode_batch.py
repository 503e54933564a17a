"""DecodeBatch: a decode step on the torch path, its sequences grouped by context length.

The sequences are sorted longest first and cut into groups whose padded context stays
within a token budget (attention_metadata.decode_group_tokens()); attention.py gathers
each group's context from the cache and attends with grouped batched matmuls. Every
index and mask that takes is built here, once per step: the gathered slots, the -inf
bias of padding and of positions after a row, the positions past each sequence's end
to zero, and for a sequence verifying drafts (1 + d query rows) the later drafts each
row must not read (DraftTail).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @classmethod
    def build(
        cls,
        start_positions: list[int],
        num_tokens: list[int],
        tables: torch.Tensor,
        block_size: int,
        group_tokens: int,
        device: torch.device,
    ) -> DecodeBatch:
        """The batch of a decode step feeding num_tokens[i] rows from start_positions[i] on.

        tables: [num_seqs, max_blocks] long block tables; group_tokens caps a group's
        padded context tokens (0: no cap)."""
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
        return cls(max_query, q_index.to(device), out_index.to(device), tuple(groups), visible)


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
