"""Linear layers that, on the CPU, multiply through a pre-packed copy of their weight.

    pack_linears(module)  # once the weights are final; FusedLinears.pack(q, k, v) fuses,
    # GatedLinears.pack(gate, up) fuses with SwiGLU's SiLU (float32)
    # (the loader calls LlamaForCausalLM.pack_projections, which does all three)

A plain GEMM repacks its weight operand into its kernel's layout on every call; at
decode batch sizes (tens of rows) that costs about as much as the multiply itself.
pack_linears reorders each weight once, into the layout of the kernel that will
multiply by it:
- float32: Tandem's panel kernel (csrc/panel_linear.cpp), column panels read front to
  back. At decode batch sizes the product streams its weights from memory, and this
  layout streams them fastest. Measured on SmolLM2-135M's projections, 2 threads, AMD
  Zen 4 (docs/model-runtime.md): a 64-row step's products 86 ms against 93.5 with
  oneDNN's packed inner product, 1 row 13 ms against 27, 1,024 rows the same. Where
  the checkpoint stores the weight quantised (a GGUF's Q4_0, Q4_1, Q5_0, Q5_1 or
  Q8_0), the packed copy keeps its codes too, which the kernel widens to the same
  float32 values for products of few rows: a quarter of the bytes, the same bits
  (coded_weight.py); where every weight is a bfloat16 or float16 value (a 16-bit
  checkpoint loaded in float32), it keeps a 16-bit copy of the panels the same way;
  where the CPU has AMX tiles and the weight is exactly one or two bfloat16 planes (a
  GGUF's Q4/Q5 codes, a 16-bit checkpoint), products of more rows run on the tiles
  instead (split_planes.py), in float32 arithmetic, faster than the FMAs;
- other dtypes, or when the kernels did not build: oneDNN's blocked layout and inner
  product (torch's own oneDNN). bfloat16 results are bit for bit F.linear's, which runs
  the same oneDNN kernel without the prepacking.

The packed copy is a second copy of the weights in memory (and its narrow panels, where
there are any, ~1.25 or 2 bytes a weight more): a plain attribute, not a
parameter or buffer, so .to() and state_dict leave it alone, and the forward uses it
only for CPU inputs of its dtype without autograd. Everything else (autograd, other
devices, a dtype neither kernel packs, TANDEM_CPU_KERNELS=0) runs F.linear, which
defines the semantics: float32 results differ from it by summation order only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model import cpu_kernels
from tandem.engine.model.coded_weight import (
    CodedWeight,
    NarrowPanels,
    narrow_panels,
    pack_coded,
    pack_gated_coded,
)
from tandem.engine.model.split_planes import (
    SPLIT_ROWS,
    SplitPlanes,
    coded_planes,
    gated_planes,
    weight_planes,
)

# oneDNN picks its blocking for this many rows; any row count runs on the result.
# Measured at 1 and 64 rows: hints from 16 to 1,024 time alike, 1 is 25 % slower at 64.
ROWS_HINT = 64


@dataclass(frozen=True)
class PackedWeight:
    """A weight's copy in the layout of the kernel that multiplies by it."""

    data: torch.Tensor  # the copy: panels for panel_linear, else oneDNN's opaque layout
    out_features: int
    panels: bool  # multiplied by Tandem's panel kernel (float32), else by oneDNN
    silu_mul: bool = False  # gate and up panels: the product is silu(gate) * up
    # The same panels in fewer bytes (coded_weight.py), exactly: the checkpoint's codes
    # where it stores the weight quantised, else 16-bit floats where every value is one.
    # The kernel widens them where few rows make the weights' bytes count.
    narrow: NarrowPanels | None = None
    # The weight as bfloat16 planes for AMX's tiles (split_planes.py), exactly, where
    # the CPU has them: products of more than SPLIT_ROWS rows run on them.
    split: SplitPlanes | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def panel_args(self, bias: torch.Tensor | None = None) -> tuple:
        """panel_linear's arguments after x."""
        c = self.narrow
        codes = (c.codes, c.scales, c.offsets, c.code_low) if c is not None else (None,) * 4
        return (self.data, self.out_features, bias, self.silu_mul, *codes)

    def kernels(self, bias: torch.Tensor | None = None) -> tuple[tuple, tuple]:
        """(kernel, its arguments after x) for products of up to SPLIT_ROWS rows, and for
        more: panel_linear, or split_linear where there are planes."""
        ops = torch.ops.tandem_cpu
        small = (ops.panel_linear.default, self.panel_args(bias))
        if self.split is None:
            return small, small
        large = (ops.split_linear.default, self.split.args(self.out_features, bias, self.silu_mul))
        return small, large

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] @ weight.T + bias."""
        if not self.panels:
            return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        rows = x.reshape(-1, x.shape[-1])  # a row-strided 2-D view stays a view
        kernel, args = self.kernels(bias)[rows.shape[0] > SPLIT_ROWS]
        return kernel(rows, *args).view(*x.shape[:-1], self.out_features)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) with an optional pre-packed weight."""

    packed: PackedWeight | None = None  # set by pack_linears
    # The checkpoint's quantised form of the weight, where it has one (set by the
    # loader, LlamaForCausalLM.load_codes): packing takes it into the packed copy if
    # it gives exactly the weight's values.
    coded: CodedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _runs_packed(self.packed, x, self.in_features):
            return self.packed.product(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class FusedLinears:
    """Bias-free Linears over the same input (q/k/v, gate/up), multiplied as one product.

    The packed weight is their concatenation, so one call replaces several: measured
    2-7 ms of a ~120 ms batch-64 decode step (fewer, wider products split better over
    the threads). The parameters stay separate, with the checkpoint's names; this is
    only the packed copy, and callers keep the separate Linears for every other case.
    """

    def __init__(self, packed: PackedWeight, sizes: list[int], in_features: int) -> None:
        self.packed = packed  # the concatenated weights' packed copy
        self.sizes = sizes  # each Linear's out_features, in order
        self.in_features = in_features

    @classmethod
    def pack(cls, *linears: Linear) -> FusedLinears | None:
        """The fused product of linears, or None where it cannot run packed here."""
        if len({m.in_features for m in linears}) != 1:
            raise ValueError("FusedLinears: the Linears must share their input width")
        if any(m.bias is not None for m in linears) or not _packable(linears[0].weight):
            return None  # checked before the concatenation, which costs a weight's memory
        with torch.no_grad():
            weight = torch.cat([m.weight for m in linears])
        codes = [m.coded for m in linears]
        coded = CodedWeight.cat(codes) if all(c is not None for c in codes) else None
        packed = _packed(weight, coded)
        if packed is None:
            return None
        return cls(packed, [m.out_features for m in linears], linears[0].in_features)

    def applies(self, x: torch.Tensor) -> bool:
        return _runs_packed(self.packed, x, self.in_features)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each Linear's output, as column views of one product."""
        return self.packed.product(x, None).split(self.sizes, dim=-1)


class GatedLinears:
    """SwiGLU's silu(gate(x)) * up(x) as one packed product, on the panel kernel (float32
    only): the product of gate and up, twice the activation's width, never reaches
    memory. Where it cannot run, pack returns None and callers fuse gate and up with
    FusedLinears, then apply silu_mul."""

    def __init__(self, packed: PackedWeight, in_features: int) -> None:
        self.packed = packed  # gate and up, packed half a panel each
        self.in_features = in_features

    @classmethod
    def pack(cls, gate: Linear, up: Linear) -> GatedLinears | None:
        weight = gate.weight
        if gate.bias is not None or up.bias is not None or up.weight.shape != weight.shape:
            return None
        ops = _panel_kernels(weight)
        if ops is None:
            return None
        coded = None
        gate_exact, up_exact = _exact(gate.coded, gate.weight), _exact(up.coded, up.weight)
        if gate_exact and up_exact:
            coded = pack_gated_coded(gate.coded, up.coded, ops)
        with torch.no_grad():
            data = ops.pack_gated_panels(weight, up.weight)
        if coded is None:
            coded = _narrow(data)
        split = None
        g = _split(ops, gate.weight, gate.coded if gate_exact else None)
        u = _split(ops, up.weight, up.coded if up_exact else None)
        if g is not None and u is not None:
            split = gated_planes(g, u)
        packed = PackedWeight(
            data, gate.out_features, panels=True, silu_mul=True, narrow=coded, split=split
        )
        return cls(packed, gate.in_features)

    def applies(self, x: torch.Tensor) -> bool:
        return _runs_packed(self.packed, x, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.product(x, None)


def packing_fits(model: nn.Module) -> bool:
    """Whether packed copies of model's packable Linear weights fit in half the memory the OS
    reports available (the rest stays for the KV cache and activations); True where it
    reports nothing. The copies are an optimisation: without them the model runs on
    F.linear, slower but in half the weights' memory. Warns when they do not fit."""
    packable = [m for m in _linears(model) if _packable(m.weight)]
    weights = {id(m.weight): m.weight for m in packable}
    need = sum(w.numel() * w.element_size() for w in weights.values())
    need += sum(m.coded.codes.numel() for m in packable if m.coded is not None)  # int8 codes
    available = available_memory()
    if available is None or need <= available // 2:
        return True
    warnings.warn(
        f"not packing the projections: the packed copies need {need / 2**30:.1f} "
        f"GiB and {available / 2**30:.1f} GiB of memory is available; the model runs on "
        "F.linear, slower (docs/model-runtime.md)",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def available_memory() -> int | None:
    """Bytes the OS reports available to new allocations (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pack_linears(model: nn.Module) -> int:
    """Pack each CPU Linear of model whose dtype a kernel here can pack; how many were packed.

    None are when TANDEM_CPU_KERNELS=0. Call again after changing weights: a packed
    copy does not follow its weight (see unpack_linears).
    """
    count = 0
    for module in _linears(model):
        module.packed = _packed(module.weight, module.coded)
        count += module.packed is not None
    return count


def unpack_linears(model: nn.Module) -> None:
    """Drop the packed copies (F.linear again), e.g. before the weights change."""
    for module in _linears(model):
        module.packed = None


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and cpu_kernels.enabled_by_env()


def _panel_kernels(weight: torch.Tensor) -> object | None:
    """torch.ops.tandem_cpu where the panel kernel multiplies by weight (a float32 CPU
    weight, the kernels on and built), else None."""
    if not _packable(weight) or weight.dtype != torch.float32:
        return None
    return cpu_kernels.load()


def _packed(weight: torch.Tensor, coded: CodedWeight | None = None) -> PackedWeight | None:
    """weight's packed copy: float32 panels (and coded ones where coded gives exactly its
    values), or oneDNN's layout for other dtypes."""
    if not _packable(weight):
        return None
    ops = _panel_kernels(weight)
    if ops is None:
        return onednn_packed(weight)
    with torch.no_grad():
        panels = ops.pack_panels(weight)
    exact = _exact(coded, weight)
    narrow = pack_coded(coded, ops) if exact else _narrow(panels)
    split = _split(ops, weight, coded if exact else None)
    return PackedWeight(panels, weight.shape[0], panels=True, narrow=narrow, split=split)


def _split(ops, weight: torch.Tensor, exact_codes: CodedWeight | None) -> SplitPlanes | None:
    """weight's planes for AMX's tiles where this process has them, the weight is exactly
    that (from exact_codes, the codes that give it, else its own values), and half the
    memory left holds them (two bfloat16 planes a weight at most)."""
    if not ops.amx_ready():
        return None
    available = available_memory()
    if available is not None and weight.numel() * 4 > available // 2:
        return None
    with torch.no_grad():
        return coded_planes(exact_codes) if exact_codes is not None else weight_planes(weight)


def _narrow(panels: torch.Tensor) -> NarrowPanels | None:
    """The panels in 16 bits where that is exact and half the memory left holds them."""
    available = available_memory()
    if available is not None and panels.numel() * 2 > available // 2:
        return None
    return narrow_panels(panels)


def _exact(coded: CodedWeight | None, weight: torch.Tensor) -> bool:
    return coded is not None and coded.matches(weight)


def onednn_packed(weight: torch.Tensor) -> PackedWeight | None:
    """weight packed for oneDNN's inner product, or None where this torch's oneDNN cannot
    (also what bench/roofline.py measures the machine's matmul peak with)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.no_grad():
            data = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROWS_HINT)
    except RuntimeError:  # e.g. float16 on a CPU without avx512_fp16: F.linear it is
        return None
    return PackedWeight(data, weight.shape[0], panels=False)


def _runs_packed(packed: PackedWeight | None, x: torch.Tensor, in_features: int) -> bool:
    return (
        packed is not None
        and x.device.type == "cpu"
        and x.dtype == packed.dtype
        and x.shape[-1] == in_features  # else F.linear names the mismatch
        and not torch.is_grad_enabled()
    )


def _linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]
