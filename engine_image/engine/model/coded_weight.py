"""CodedWeight: a weight as its quantised checkpoint stores it, for exact float32 products.

    coded = CodedWeight.from_gguf_blocks(blocks, "Q4_1", shape)  # or None: not a code form
    coded.matches(weight)   # every float32 value equals scale * code (+ offset), bit for bit
    pack_coded(coded, ...)  # NarrowPanels for panel_linear (csrc/panel_linear.cpp)
    narrow_panels(panels)   # float32 panels in 16 bits, where every value is exact

A GGUF file stores SmolLM2's projections as Q4_1: each run of 32 inputs of an output
row holds 4-bit codes with one float16 scale and offset, and the loader's float32
weight is (scale * code) + offset, rounded after each operation. The float32 model
multiplies by exactly those values. Beside the float32 panels, the packed copy keeps
them in this form (an int8 code a weight, a float32 scale and offset a block: ~1.1
bytes a weight instead of 4), and for products of up to 32 rows (small decode
steps) the panel kernel widens each panel's codes back to the same float32 values
once for all the rows it multiplies. The products are bit for bit those of the
float32 panels; such a step streams a quarter of the bytes. Measured on SmolLM2, 2
threads, a Xeon: batch-1 decode 1.9-2.0x as fast, 2.0-2.3x when sampling (the LM
head's codes too). More rows keep the float32 panels: their products are bound by the
arithmetic, which the widening adds to (docs/benchmarks.md). Where a checkpoint
stores 16-bit floats, narrow_panels keeps the panels in 16 bits the same way.

Only forms whose widening is one multiply and at most one add qualify: GGUF's Q4_0,
Q4_1, Q5_0, Q5_1 and Q8_0 (not the k-quants, whose scales are themselves quantised
in super-blocks). Packing checks every value against the float32 weight before it
trusts the codes (matches), so a checkpoint whose dequantisation rounds otherwise,
or weights changed since loading, fall back to the float32 panels instead of giving
different results.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# Inputs sharing a scale in the GGUF block forms taken here.
GGUF_BLOCK = 32


@dataclass(frozen=True)
class CodedWeight:
    """weight[n, k] = scales[n, k // block] * codes[n, k] (+ offsets[n, k // block]),
    each operation rounded to float32."""

    codes: torch.Tensor  # int8 [out_features, in_features]
    scales: torch.Tensor  # float32 [out_features, in_features // block]
    offsets: torch.Tensor | None  # as scales, or None: no offset is added

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.codes.dtype != torch.int8 or self.scales.dtype != torch.float32:
            raise ValueError("CodedWeight: codes must be int8 and scales float32")
        if self.scales.dim() != 2 or self.scales.shape[0] != n or self.scales.shape[1] < 1:
            raise ValueError(f"CodedWeight: scales {tuple(self.scales.shape)} for codes {(n, k)}")
        if k % self.scales.shape[1]:
            raise ValueError(
                f"CodedWeight: {k} inputs do not split into {self.scales.shape[1]} blocks"
            )
        if self.offsets is not None and (
            self.offsets.shape != self.scales.shape or self.offsets.dtype != torch.float32
        ):
            raise ValueError("CodedWeight: offsets must be float32 and shaped as the scales")

    @property
    def block(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @classmethod
    def from_gguf_blocks(
        cls, blocks: np.ndarray, kind: str, shape: tuple[int, int]
    ) -> CodedWeight | None:
        """The codes of a GGUF tensor's raw blocks (uint8 [..., bytes]) of type `kind`
        (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), for a weight of `shape` [out, in]; None for
        other types. Each block of 32: a float16 scale d, for the _1 types a float16
        offset m, then the codes; the weight is d * code (+ m), as gguf dequantises."""
        if kind not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
            return None
        out, inp = shape
        raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(out * inp // GGUF_BLOCK, -1)
        scale = raw[:, 0:2].view(np.float16)
        offset = raw[:, 2:4].view(np.float16) if kind in ("Q4_1", "Q5_1") else None
        rest = raw[:, 2:] if offset is None else raw[:, 4:]
        if kind == "Q8_0":
            codes = rest.view(np.int8).astype(np.int16)
        else:
            high = None
            if kind.startswith("Q5"):  # 32 fifth bits, little-endian, before the nibbles
                bits = rest[:, :4].copy().view("<u4")
                high = (bits >> np.arange(GGUF_BLOCK, dtype=np.uint32)) & 1
                rest = rest[:, 4:]
            codes = np.concatenate([rest & 0x0F, rest >> 4], axis=1).astype(np.int16)  # j, j + 16
            if high is not None:
                codes |= (high << 4).astype(np.int16)
            if offset is None:  # the _0 types are centred: q - 8, q - 16
                codes -= 16 if kind == "Q5_0" else 8
        blocks_per_row = inp // GGUF_BLOCK

        def table(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(values.astype(np.float32).reshape(out, blocks_per_row))

        return cls(
            codes=torch.from_numpy(codes.astype(np.int8).reshape(out, inp)),
            scales=table(scale),
            offsets=None if offset is None else table(offset),
        )

    def rows(self, order: np.ndarray) -> CodedWeight:
        """The same weight with its rows (outputs) reordered: row i is row order[i]."""
        index = torch.from_numpy(np.asarray(order, dtype=np.int64))
        offsets = None if self.offsets is None else self.offsets[index]
        return CodedWeight(self.codes[index], self.scales[index], offsets)

    def widened(self) -> torch.Tensor:
        """The float32 weight the codes stand for (two rounded operations, no FMA)."""
        return self._widen()[2]

    def matches(self, weight: torch.Tensor) -> bool:
        """Whether weight holds exactly these values, bit for bit (signs of zero too), and
        every scale * code is exact in float32, so that the kernel may fuse the multiply
        and add (a GGUF's float16 scales times 8-bit codes always are)."""
        if weight.dtype != torch.float32 or weight.shape != self.codes.shape:
            return False
        scales, products, values = self._widen()
        if not torch.equal(self.codes.double() * scales.double(), products.double()):
            return False
        return torch.equal(values.view(torch.int32), weight.detach().cpu().view(torch.int32))

    def _widen(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per weight: its scale, scale * code, and that + offset, each rounded to float32."""
        scales = self.scales.repeat_interleave(self.block, dim=1)
        products = self.codes.float() * scales
        if self.offsets is None:
            return scales, products, products
        return scales, products, products + self.offsets.repeat_interleave(self.block, dim=1)

    @staticmethod
    def cat(parts: list[CodedWeight]) -> CodedWeight | None:
        """The weights stacked along the outputs (fused q/k/v), or None where their
        blocks or offset forms differ."""
        if len({(p.block, p.offsets is None) for p in parts}) != 1:
            return None
        offsets = None if parts[0].offsets is None else torch.cat([p.offsets for p in parts])
        return CodedWeight(
            torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), offsets
        )


@dataclass(frozen=True)
class NarrowPanels:
    """Float32 panels' values in fewer bytes, in panel_linear's layout (panels of
    `columns` outputs): a CodedWeight's int8 codes with their scales and offsets, or
    the panels themselves in bfloat16 or float16 where every value is one exactly."""

    codes: torch.Tensor  # [panels, in_features, columns]: int8, bfloat16 or float16
    scales: torch.Tensor | None  # int8 codes': float32 [panels, in_features // block, columns]
    offsets: torch.Tensor | None
    # Set where the int8 codes lie within 16 values (Q4_0's, Q4_1's): they are stored two
    # a byte, uint8 [panels, in_features // 2, columns], each byte rows 2i and 2i + 1 of
    # a column less code_low, low half first. Small decode steps read every code once:
    # half the bytes took a batch-1 SmolLM2 step from ~9.1 to ~7.3 ms (docs/model-runtime.md).
    code_low: int | None = None

    def int8_codes(self) -> torch.Tensor:
        """The codes one a byte, [panels, in_features, columns], as stored before packing."""
        if self.code_low is None:
            return self.codes
        rows = torch.stack([self.codes & 15, self.codes >> 4], dim=2).flatten(1, 2)
        return (rows.to(torch.int16) + self.code_low).to(torch.int8)


def narrow_panels(panels: torch.Tensor) -> NarrowPanels | None:
    """float32 panels as bfloat16 or float16 where that holds every value exactly (a
    bfloat16 or float16 checkpoint loaded in float32), else None."""

    def exact(t: torch.Tensor, narrow: torch.Tensor) -> bool:
        return torch.equal(narrow.float().view(torch.int32), t.view(torch.int32))

    head = panels.reshape(-1)[:4096]  # most float32 weights fail here, before a full copy
    for dtype in (torch.bfloat16, torch.float16):
        if exact(head, head.to(dtype)):
            narrow = panels.to(dtype)
            if exact(panels, narrow):
                return NarrowPanels(narrow, None, None)
    return None


def pack_coded(coded: CodedWeight, ops) -> NarrowPanels:
    """coded in panel_linear's layout, by the kernels' own packer (ops: torch.ops.tandem_cpu):
    codes, scales and offsets each take the float32 panels' shape, a scale's row a block."""
    offsets = None if coded.offsets is None else ops.pack_panels(coded.offsets)
    codes, low = _two_a_byte(ops.pack_panels(coded.codes), coded.block)
    return NarrowPanels(codes, ops.pack_panels(coded.scales), offsets, low)


def pack_gated_coded(gate: CodedWeight, up: CodedWeight, ops) -> NarrowPanels | None:
    """For the SwiGLU product: gate and up laid out as pack_gated_panels lays out their
    float32 weights (half a panel each); None where the two forms differ."""
    if (
        gate.shape != up.shape
        or gate.block != up.block
        or (gate.offsets is None) != (up.offsets is None)
    ):
        return None
    pack = ops.pack_gated_panels
    offsets = None if gate.offsets is None else pack(gate.offsets, up.offsets)
    codes, low = _two_a_byte(pack(gate.codes, up.codes), gate.block)
    return NarrowPanels(codes, pack(gate.scales, up.scales), offsets, low)


def _two_a_byte(codes: torch.Tensor, block: int) -> tuple[torch.Tensor, int | None]:
    """Packed int8 codes [panels, in_features, columns] two a byte, and their least
    code, where they lie within 16 values and every block of a scale holds an even
    number of inputs; else as they are, and None."""
    if not codes.numel() or block % 2:
        return codes, None
    low = int(codes.min())
    if int(codes.max()) - low >= 16:
        return codes, None
    offset = (codes.to(torch.int16) - low).to(torch.uint8)
    return (offset[:, 0::2] | (offset[:, 1::2] << 4)).contiguous(), low
