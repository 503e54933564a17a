"""Linear layers that, on the CPU, multiply through a packed copy of their weight.

    pack_linears(model)  # once the weights are final (the loader does it)

A plain sgemm repacks its weight operand into its kernel's panel layout on every
call; at decode batch sizes (tens of rows) that costs about as much as the
multiply itself. MKL's pack API does it once: after pack_linears, an inference
forward on a float32 CPU matrix runs cpu_kernels' packed_linear on the packed copy.
Measured on SmolLM2-135M's projections, 2 threads: ~17 % less matmul time than
F.linear at 64 rows (a decode step, docs/benchmarks.md), ~5 % at 256, even at
512, and 4 % more at 1,024, where F.linear's repacking is amortised and its own
blocking wins: so only steps under PACKED_MAX_ROWS rows use the packed copy.

The packed copy is a second copy of the weights in memory, in MKL's layout, which
must never move: it is a plain attribute, not a parameter or buffer, so .to() and
state_dict leave it alone, and the forward uses it only for float32 CPU inputs
without autograd. Everything else (autograd, other devices or dtypes, a torch
without MKL, TANDEM_CPU_KERNELS=0) runs F.linear, which defines the semantics:
results differ from it by float rounding order only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model import cpu_kernels

# Row counts from which F.linear is at least as fast (see above).
PACKED_MAX_ROWS = 512


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) with an optional packed weight."""

    packed: torch.Tensor | None = None  # MKL's packed W, set by pack_linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if (
            packed is not None
            and x.dim() == 2
            and x.shape[0] < PACKED_MAX_ROWS
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and not torch.is_grad_enabled()
        ):
            return torch.ops.tandem_cpu.packed_linear(x, packed, self.weight)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Pack each bias-free float32 CPU Linear of model; how many were packed.

    None are when the C++ kernels or torch's MKL are unavailable. Call again after
    changing weights: a packed copy does not follow its weight (see unpack_linears).
    """
    ops = cpu_kernels.load()
    if ops is None or not ops.packed_gemm_available():
        return 0
    count = 0
    with torch.no_grad():
        for module in _linears(model):
            module.packed = None
            weight = module.weight
            on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
            if module.bias is None and on_cpu:
                module.packed = ops.pack_linear_weight(weight)
                count += 1
    return count


def unpack_linears(model: nn.Module) -> None:
    """Drop the packed copies (F.linear again), e.g. before the weights change."""
    for module in _linears(model):
        module.packed = None


def _linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]
