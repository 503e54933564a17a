"""Linear layers that, on the CPU, multiply through a pre-packed copy of their weight.

    pack_linears(model)  # once the weights are final (the loader does it)

A plain GEMM repacks its weight operand into its kernel's panel layout on every
call; at decode batch sizes (tens of rows) that costs about as much as the
multiply itself. pack_linears reorders each weight once into oneDNN's blocked
layout (torch's own oneDNN, the library its CPU convolutions and bfloat16
matmuls run on); an inference forward on the CPU then runs oneDNN's inner
product on that copy. Measured on SmolLM2-135M's projections, 2 threads, AMD
Zen 4 (docs/model-runtime.md): float32 1.7x faster than F.linear (MKL) at 64
rows, 2.1x at 1 row, 1.2x at 1,024; bfloat16 1.3-1.7x, bit for bit equal to
F.linear (which runs oneDNN without the prepacking).

The packed copy is a second copy of the weights in memory, in oneDNN's opaque
layout: it is a plain attribute, not a parameter or buffer, so .to() and
state_dict leave it alone, and the forward uses it only for CPU inputs of its
dtype without autograd. Everything else (autograd, other devices, a torch
without oneDNN, a dtype this CPU's oneDNN cannot pack, TANDEM_CPU_KERNELS=0)
runs F.linear, which defines the semantics: float32 results differ from it by
summation order only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model import cpu_kernels

# oneDNN picks its blocking for this many rows; any row count runs on the result.
# Decode batches are tens of rows; measured, 1, 64 or 1,024 change no timing beyond noise.
ROWS_HINT = 64


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) with an optional pre-packed weight."""

    packed: torch.Tensor | None = None  # oneDNN's copy of weight, set by pack_linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if (
            packed is not None
            and x.device.type == "cpu"
            and x.dtype == packed.dtype
            and x.shape[-1] == self.in_features  # else F.linear names the mismatch
            and not torch.is_grad_enabled()
        ):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Pack each CPU Linear of model whose dtype oneDNN can pack here; how many were packed.

    None are when TANDEM_CPU_KERNELS=0 or torch has no oneDNN. Call again after
    changing weights: a packed copy does not follow its weight (see unpack_linears).
    """
    if not cpu_kernels.enabled_by_env() or not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    with torch.no_grad():
        for module in _linears(model):
            module.packed = None
            if module.weight.device.type == "cpu":
                module.packed = _packed(module.weight)
                count += module.packed is not None
    return count


def unpack_linears(model: nn.Module) -> None:
    """Drop the packed copies (F.linear again), e.g. before the weights change."""
    for module in _linears(model):
        module.packed = None


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)
    except RuntimeError:  # e.g. float16 on a CPU without avx512_fp16: F.linear it is
        return None


def _linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]
