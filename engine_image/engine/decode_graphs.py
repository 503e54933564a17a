"""DecodeGraphs: plain decode steps replayed from CUDA graphs.

On a GPU a small model's decode step is bound by the CPU launching its kernels
(~1,200 a step for SmolLM2-135M's 30 layers, 10-20 us of CPU each), not by the
GPU's work (~3.5 ms of it at batch 64): docs/benchmarks.md, "On CUDA". A CUDA
graph records a step's kernels once and replays them all with one launch.

A graph holds fixed shapes, so a step is padded to one: its batch to the next
power of two rows (at most max_rows), its block tables to the next power of two
blocks wide (at most max_width), and the attention reads each sequence's length
from a tensor (model/padded_attention.py). One graph per (rows, width), recorded
the first time a step needs it; all share one memory pool, as one runs at a time.
Every input of a graph is a view of one int64 staging tensor, so a step's inputs
travel in one host-to-device copy.

Which steps: decode steps feeding one token per sequence (no drafts). Steps that
verify drafts, prefill steps and steps past the largest shape run eagerly.

Recording runs the step once first (CUDA graphs need a warm-up run, on a side
stream) with the step's own inputs, so the K/V it writes are exactly those the
replay writes again: recording mid-serving disturbs no sequence's cache.

With capture=False (the CPU: tests) the same padded steps run eagerly. The
padding and the padded attention are what the CPU suite checks; only the
recording needs a GPU.
"""

from __future__ import annotations

import torch

from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.model.padded_attention import PaddedDecode
from tandem.engine.plan import StepPlan


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        *,
        max_rows: int,
        max_width: int,
        capture: bool | None = None,
    ) -> None:
        if max_rows < 1 or max_width < 1:
            raise ValueError(
                f"decode graphs need max_rows and max_width >= 1, got {max_rows}, {max_width}"
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
        self.max_rows = max_rows
        self.max_width = max_width
        self.device = device
        self._steps: dict[tuple[int, int], _PaddedStep] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """The (rows, width) shapes prepared so far (recorded, where capture is on)."""
        return sorted(self._steps)

    def takes(self, plan: StepPlan) -> bool:
        """Whether this step runs padded: a decode step of one token per sequence that
        fits the largest shape."""
        seqs = plan.seqs
        return (
            not plan.is_prefill
            and 0 < len(seqs) <= self.max_rows
            and all(len(s.token_ids) == 1 and len(s.block_ids) <= self.max_width for s in seqs)
        )

    def forward(
        self, input_ids: list[int], positions: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """Final hidden states [n, hidden] for n sequences each feeding input_ids[i] at
        positions[i] through block table tables[i]: a view into the graph's output, valid
        until the next step."""
        n = len(input_ids)
        rows = _bucket(n, self.max_rows)
        width = _bucket(max(len(t) for t in tables), self.max_width)
        step = self._steps.get((rows, width))
        if step is None:
            step = self._steps[rows, width] = _PaddedStep(rows, width, self.device)
        step.load(input_ids, positions, tables, self.block_size)
        if not self.capture:
            return step.run(self.model, self.kv_caches)[:n]
        if step.graph is None:
            self._record(step)
        step.graph.replay()
        return step.hidden[:n]

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
    """One (rows, width) shape: its staging tensor, the model's inputs as views of it,
    and its graph once recorded."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        # ids, positions, slots, lengths, write rows: rows each; then the tables.
        self.staging = torch.zeros(rows * (5 + width), dtype=torch.long, device=device)
        ids, positions, slots, lengths, write_rows, tables = self.staging.split(
            [rows] * 5 + [rows * width]
        )
        self.input_ids = ids
        padded = PaddedDecode(write_rows, tables.view(rows, width), lengths)
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

    def load(
        self, input_ids: list[int], positions: list[int], tables: list[list[int]], block_size: int
    ) -> None:
        """The step's inputs into the staging tensor; padding rows repeat row 0's."""
        pad = self.rows - len(input_ids)
        slots = [
            t[p // block_size] * block_size + p % block_size
            for t, p in zip(tables, positions, strict=True)
        ]
        values = [*input_ids, *[input_ids[0]] * pad]
        values += [*positions, *[positions[0]] * pad]
        values += [*slots, *[slots[0]] * pad]
        values += [p + 1 for p in positions] + [positions[0] + 1] * pad
        values += [*range(len(input_ids)), *[0] * pad]
        width = self.width
        for table in tables:
            values += table
            values += [0] * (width - len(table))  # block 0: a valid id, masked
        values += (tables[0] + [0] * (width - len(tables[0]))) * pad
        self.staging.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)

    def run(self, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        return model(self.input_ids, self.meta.positions, kv_caches, self.meta)


def _bucket(n: int, cap: int) -> int:
    """The next power of two from n, at most cap."""
    return min(1 << (n - 1).bit_length(), cap)
