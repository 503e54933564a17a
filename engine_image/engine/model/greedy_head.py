"""The LM head's argmax for greedy rows, without every float32 logit.

    head = GreedyHead.pack(lm_head)  # None where it cannot run (see pack)
    tokens = head(hidden)            # int64 [rows]: argmax(lm_head(hidden)), the same tokens

A greedy step needs one token per row, not the [rows, vocab] logits. The kernel
(csrc/greedy_head.cpp) screens every token with bfloat16 dot products (vdpbf16ps, twice
the float32 FMA rate on AMD Zen 4, half the bytes; on AMX's tiles where the CPU and OS
allow, ~4x vdpbf16ps on a Xeon), bounds the screen's error rigorously, and
computes float32 logits only where the bound cannot rule tokens out (a panel or
two of 48 tokens), from the float32 head's own panels as panel_linear sums them.
The decision is the float32 head's, bit for bit, ties and all; the bound and its
proof are in the kernel's header.

SmolLM2-135M's head is a fifth of a decode step's FLOPs (49,152 x 576): a batch-64
step's head 18 ms in float32 (panel_linear), ~11 ms screened on Zen 4; on a Xeon
with AMX 18-19 ms on vdpbf16ps, 4.6 on the tiles (docs/benchmarks.md).
The cost: a bfloat16 copy of the head, half the float32 weight's size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tandem.engine.model import cpu_kernels
from tandem.engine.model.linear import Linear, available_memory


@dataclass(frozen=True)
class GreedyHead:
    """The LM head's copies the screen reads."""

    panels: torch.Tensor  # the weight in bfloat16, in the screen's panels
    float_panels: torch.Tensor  # the head's own float32 panels (panel_linear's): exact logits
    norms: torch.Tensor  # |w_j| per token, float32, rounded up: the bound's
    tiles: bool = False  # screen on AMX tiles (~4x vdpbf16ps at batch 64), else vdpbf16ps

    @classmethod
    def pack(cls, head: Linear) -> GreedyHead | None:
        """The screen for a head without bias that runs on the float32 panel kernel (packed:
        pack_linears), where the kernels are built with AVX512-BF16 and the bfloat16 copy
        fits in half the memory left; else None (the float32 head and argmax run)."""
        weight, packed = head.weight, head.packed
        if (
            packed is None
            or not packed.panels
            or head.bias is not None
            or not cpu_kernels.has_bf16_dot()
        ):
            return None
        ops = cpu_kernels.load()
        available = available_memory()
        if ops is None or (available is not None and weight.numel() * 2 > available // 2):
            return None
        with torch.no_grad():
            # bfloat16 would turn a weight from 2^127 on into infinity, and a NaN (a
            # corrupt checkpoint) defeats the bound: such a head stays float32.
            if not bool((weight.abs() < 2.0**127).all()):
                return None
            norms = torch.linalg.vector_norm(weight.double(), dim=1).float()
            norms = torch.nextafter(norms, torch.full_like(norms, math.inf))
            return cls(ops.pack_bf16_panels(weight), packed.data, norms, tiles=ops.amx_ready())

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token ids [rows]: the first maximum of each row's float32 logits."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        return torch.ops.tandem_cpu.greedy_head(
            rows, self.panels, self.float_panels, self.norms, self.norms.shape[0], self.tiles
        )
