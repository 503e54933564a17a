"""DecodeGraphs: decode steps replayed from CUDA graphs.

On a GPU a small model's decode step is bound by the CPU launching its kernels
(~1,200 a step for SmolLM2-135M's 30 layers, 10-20 us of CPU each), not by the
GPU's work (~3.5 ms of it at batch 64): docs/benchmarks.md, "On CUDA". A CUDA
graph records a step's kernels once and replays them all with one launch.

A graph holds fixed shapes, so a step is padded to one: its batch to the next
power of two sequences (at most max_seqs), each sequence to Q query rows (1, or
max_queries = 1 + the engine's num_speculative_tokens when the step verifies
drafts), its block tables to the next power of two blocks wide (at most
max_width); the attention reads each sequence's first position and length from
tensors (model/padded_attention.py), and a shape gathers at most
MAX_GATHER_BYTES of K/V a layer. One graph per (sequences, Q, width),
recorded the first time a step needs it; all share one memory pool, as one runs
at a time. Every input of a graph is a view of one int64 staging tensor, so a
step's inputs travel in one host-to-device copy. Prefill steps, and steps past
the largest shape, run op by op.

Recording runs the step once first (CUDA graphs need a warm-up run, on a side
stream) with the step's own inputs, so the K/V it writes are exactly those the
replay writes again: recording mid-serving disturbs no sequence's cache.

With capture=False (the CPU: tests) the same padded steps run unrecorded. The
padding and the padded attention are what the CPU suite checks; only the
recording needs a GPU.
"""

from __future__ import annotations

import torch

from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.model.padded_attention import PaddedDecode
from tandem.engine.plan import ScheduledSeq, StepPlan

# The most K/V bytes a padded step gathers a layer (padded_attention.py): its
# sequences times its width. Bigger shapes run op by op, so that recording one
# never runs the GPU out of memory mid-serving; at this budget SmolLM2-135M's widest
# shape (256 sequences of 2,048 tokens, 0.4 GiB) is recorded, an 8B model's (2 GiB
# at 4 KiB a token) is not, its batch 64 at 2,048 tokens (0.5 GiB) is.
MAX_GATHER_BYTES = 512 << 20


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        *,
        max_seqs: int,
        max_width: int,
        max_queries: int = 1,
        max_gather_bytes: int = MAX_GATHER_BYTES,
        capture: bool | None = None,
    ) -> None:
        if min(max_seqs, max_width, max_queries) < 1:
            raise ValueError(
                "decode graphs need max_seqs, max_width and max_queries >= 1, got "
                f"{max_seqs}, {max_width}, {max_queries}"
            )
        device = kv_caches[0].device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(
                f"CUDA graphs record steps on a CUDA device; the KV cache is on {device}"
            )
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_width = max_width
        self.max_queries = max_queries
        self.max_gather_bytes = max_gather_bytes
        cache = kv_caches[0]  # [2, blocks, block_size, kv_heads, head_dim]
        self._token_bytes = 2 * cache.shape[3] * cache.shape[4] * cache.element_size()
        self.device = device
        self._steps: dict[tuple[int, int, int], _PaddedStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The (sequences, queries, width) shapes prepared so far (recorded, where
        capture is on)."""
        return sorted(self._steps)

    def shape_for(self, plan: StepPlan) -> tuple[int, int, int] | None:
        """The (sequences, queries, width) shape this step runs padded at, or None: not a
        decode step, past the largest shape, or gathering more than max_gather_bytes of
        K/V a layer."""
        seqs = plan.seqs
        if plan.is_prefill or not 0 < len(seqs) <= self.max_seqs:
            return None
        tokens = max(len(s.token_ids) for s in seqs)
        blocks = max(len(s.block_ids) for s in seqs)
        if tokens > self.max_queries or blocks > self.max_width:
            return None
        padded, width = _bucket(len(seqs), self.max_seqs), _bucket(blocks, self.max_width)
        if padded * width * self.block_size * self._token_bytes > self.max_gather_bytes:
            return None
        return padded, 1 if tokens == 1 else self.max_queries, width

    def forward(self, seqs: list[ScheduledSeq], shape: tuple[int, int, int]) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's T tokens at `shape` (shape_for's),
        in the step's flat order (each sequence's tokens in turn): a view into the
        graph's output, or gathered from it, valid until the next step."""
        step = self._steps.get(shape)
        if step is None:
            step = self._steps[shape] = _PaddedStep(*shape, self.device)
        tokens = step.load(seqs, self.block_size)
        if not self.capture:
            hidden = step.run(self.model, self.kv_caches)
        else:
            if step.graph is None:
                self._record(step)
            step.graph.replay()
            hidden = step.hidden
        if step.queries == 1:
            return hidden[:tokens]
        return hidden.index_select(0, step.out_rows[:tokens])

    def _record(self, step: _PaddedStep) -> None:
        # Warm-up on a side stream (cuBLAS picks and allocates its workspaces outside
        # the capture), as torch.cuda.graphs documents.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step.run(self.model, self.kv_caches)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a KV transfer) may go on meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step.hidden = step.run(self.model, self.kv_caches)
        step.graph = graph


class _PaddedStep:
    """One (sequences, queries, width) shape: its staging tensor, the model's inputs as
    views of it, and its graph once recorded."""

    def __init__(self, seqs: int, queries: int, width: int, device: torch.device) -> None:
        self.seqs, self.queries, self.width = seqs, queries, width
        rows = seqs * queries
        # Per row: ids, positions, slots, write rows, out rows; per sequence: starts,
        # lengths; then the tables.
        self.staging = torch.zeros(5 * rows + seqs * (2 + width), dtype=torch.long, device=device)
        ids, positions, slots, write_rows, out_rows, starts, lengths, tables = self.staging.split(
            [rows] * 5 + [seqs, seqs, seqs * width]
        )
        self.input_ids, self.out_rows = ids, out_rows
        padded = PaddedDecode(write_rows, tables.view(seqs, width), starts, lengths)
        self.meta = AttentionMetadata(
            is_prefill=False,
            positions=positions,
            slot_mapping=slots,
            decode=None,
            prefill_seqs=(),
            padded=padded,
        )
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None  # the graph's output

    def load(self, seqs: list[ScheduledSeq], block_size: int) -> int:
        """The step's inputs into the staging tensor; returns its token count. A
        sequence's padding rows repeat its last token; padding sequences repeat
        sequence 0."""
        queries, width = self.queries, self.width
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        write_rows: list[int] = []
        out_rows: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        tables: list[int] = []
        for s, seq in enumerate(seqs):
            tokens, start, table = seq.token_ids, seq.start_pos, seq.block_ids
            count = len(tokens)
            out_rows.extend(range(s * queries, s * queries + count))
            for r in range(queries):
                real = min(r, count - 1)
                p = start + real
                ids.append(tokens[real])
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
                write_rows.append(s * queries + real)
            starts.append(start)
            lengths.append(start + count)
            tables += table
            tables += [0] * (width - len(table))  # block 0: a valid id, masked
        pad = self.seqs - len(seqs)
        values = [*ids, *ids[:queries] * pad]
        values += [*positions, *positions[:queries] * pad]
        values += [*slots, *slots[:queries] * pad]
        values += [*write_rows, *write_rows[:queries] * pad]
        tokens = len(out_rows)
        values += [*out_rows, *[0] * (self.seqs * queries - tokens)]
        values += [*starts, *starts[:1] * pad]
        values += [*lengths, *lengths[:1] * pad]
        values += [*tables, *tables[:width] * pad]
        self.staging.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        return tokens

    def run(self, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return model(self.input_ids, self.meta.positions, kv_caches, self.meta)


def _bucket(n: int, cap: int) -> int:
    """The next power of two from n, at most cap."""
    return min(1 << (n - 1).bit_length(), cap)
