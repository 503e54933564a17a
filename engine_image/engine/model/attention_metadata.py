"""AttentionMetadata: everything a step's attention needs, computed once per step.

Each layer's cache is one tensor kv[2, num_blocks, block_size, num_kv_heads, head_dim]
(0 = K, 1 = V); a sequence's KV for position p lives at
block_table[p // block_size], offset p % block_size. The runner builds one
AttentionMetadata per step from the scheduler's block tables; every index and
mask the kernels (attention.py) need is computed here, so per-layer work is
tensor math only. Which decode path a step takes is decided here too:
`paged` for the C++ CPU kernel, `decode` (groups of similar context length,
decode_batch.py) for the torch path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tandem.engine.model import cpu_kernels
from tandem.engine.model.decode_batch import DecodeBatch
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
            decode = DecodeBatch.build(
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
