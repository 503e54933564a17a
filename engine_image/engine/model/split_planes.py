"""SplitPlanes: a weight as bfloat16 planes or codes, for float32 products on AMX tiles.

    planes = coded_planes(coded)      # a GGUF's codes and scales, as the kernel takes them
    planes = weight_planes(weight)    # a bfloat16 (one plane) or float16 (two) checkpoint's
    gated = gated_planes(gate, up)    # SwiGLU's pair, for split_linear(..., silu_mul=True)
    y = torch.ops.tandem_cpu.split_linear(x, *planes.args(n, bias=None, silu_mul=False))

Where the CPU has AMX (a Xeon since Sapphire Rapids), its tiles multiply bfloat16 at
~16x the rate of the float32 FMA units. csrc/split_linear.cpp uses them for float32
products: it splits x into three bfloat16 parts exactly, multiplies them by weights
that are exactly bfloat16 values, each product exact in float32, and the tiles sum
them in float32 (the file says which terms it leaves out, each under 2^-24 of its
product). Past a few rows (SPLIT_ROWS), a decode step or a prefill is bound by the
float32 FMAs, and the codes' widening (coded_weight.py) adds to them; on the tiles, SmolLM2's
products chained through its layers ran ~1.45x as fast at 64 rows and ~1.7x at 1,024,
a Xeon, 2 threads (docs/benchmarks.md).

Which weights qualify: a GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weight, kept as its codes
(exact in bfloat16; Q4_0's and Q4_1's two a byte, the others int8) and scales, ~0.75
or ~1.25 bytes a weight: the tiles multiply x's parts by the codes, and each block of
32 inputs' sums take the column's scale in float32 as they leave the tiles (planes of
scale * code, 4 bytes a weight, bound a batch-64 step by their reading). The _1
forms' offsets ride as extra inputs against x's sums over each block
(split_linear.cpp). The result is the float32 dot product of scale * code
+ offset, the loader's weight or that weight before its last rounding (half an ulp
from it), summed in another order. A bfloat16 checkpoint's weights are one plane,
float16's two, stored. Plain float32 weights would need three planes stored (6 bytes
a weight): they keep the float32 panels.

One difference in kind: an infinity in x meets x's lower parts, NaN after the split
(inf - inf), so such an output is NaN where F.linear gives an infinity. A hidden state
holding an infinity has overflowed already.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.model.coded_weight import CodedWeight

TILE_COLUMNS = 16  # output columns of an AMX tile of sums
TILE_K = 32  # inputs a tile's row of bfloat16 pairs covers
# Planes a stored weight may take: two (4 bytes a weight, as the float32 panels).
MOST_PLANES = 2
MOST_TAIL_PLANES = 3  # the offsets' columns: any float32 value
# Products of more rows than this run on the planes; fewer widen the codes in
# panel_linear (which widens up to its own WIDEN_ROWS, 32, where there are no planes).
# Chained SmolLM2 products, a Xeon, with the codes converted through their table while
# the tiles work (split_linear.cpp): 8 rows 8.5-9.0 ms widened against 9.0-9.6 on the
# tiles, 9 rows 12.5-12.8 against 9.2-9.4, 10 rows 12.9 against 9.0 (a row tile of the
# tiles takes 16 rows, so up to 16 cost alike there). (Before the table, 12 rows 13.6
# widened against 12.5 on the tiles: the bar was 10.)
SPLIT_ROWS = 8
PANEL_WIDEN_ROWS = 32  # csrc/panel_linear.cpp's WIDEN_ROWS


@dataclass(frozen=True)
class SplitPlanes:
    """A weight [out, in] as split_linear takes it."""

    # bfloat16 [column tiles, k blocks, planes, 16, 32]: per 16 output columns and 32
    # inputs (the inputs continued by the offsets' columns, where sums_block is set),
    # each plane as an AMX B tile, row q holding the column pairs (w[n, 2q], w[n, 2q + 1]).
    planes: torch.Tensor
    # x's sums over each block of this many inputs meet the offsets' columns; 0: none.
    sums_block: int
    # A coded weight's codes, int8 [column tiles, k blocks, 16, 32] in the planes' layout,
    # which the tiles multiply by as they are (each block's sums then take its scale);
    # `planes` then holds only the offsets' columns (the tail). None: the planes hold it all.
    # Codes within 16 values (Q4_0's, Q4_1's) are stored two a byte, uint8 [..., 16]: byte
    # i of a row holds codes i and i + 16 less code_low, low nibble first. A decode step
    # reads every code once, so half their bytes is ~3 ms of a SmolLM2 batch-64 step.
    codes: torch.Tensor | None = None
    # The codes' scales, float32 [column tiles, k blocks, 16]: each column's, a block of 32.
    scales: torch.Tensor | None = None
    # Where every code lies in [code_low, code_low + 32) (a 4- or 5-bit type's), the kernel
    # converts them to bfloat16 through a table; None (Q8_0's): through float32.
    code_low: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def int8_codes(self) -> torch.Tensor | None:
        """The codes as int8 [column tiles, k blocks, 16, 32], unpacked where stored two a byte."""
        if self.codes is None or self.codes.dtype == torch.int8:
            return self.codes
        low, high = self.codes & 15, self.codes >> 4
        return (torch.cat([low, high], dim=-1).to(torch.int16) + self.code_low).to(torch.int8)

    def args(self, out_features: int, bias: torch.Tensor | None, silu_mul: bool) -> tuple:
        """split_linear's arguments after x."""
        return (
            self.planes,
            out_features,
            self.sums_block,
            bias,
            silu_mul,
            self.codes,
            self.scales,
            self.code_low,
        )

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.planes, self.codes, self.scales) if t is not None]


def coded_planes(coded: CodedWeight) -> SplitPlanes | None:
    """coded's codes and scales, which the kernel multiplies by as they are (the scale
    applied to each block's sums), and its offsets' columns as planes; None where the
    inputs do not come in whole tiles, or a block of codes is not one of 32 or more."""
    n, k = coded.shape
    if k % TILE_K or coded.block % TILE_K:  # a tile's 32 inputs share one scale
        return None
    tiles = -(-n // TILE_COLUMNS)
    scales = coded.scales.repeat_interleave(coded.block // TILE_K, dim=1)  # a tile's block
    tile_scales = torch.zeros(tiles * TILE_COLUMNS, k // TILE_K)
    tile_scales[:n] = scales
    tile_scales = tile_scales.view(tiles, TILE_COLUMNS, -1).transpose(1, 2)
    codes, low = _stored(_tiles([coded.codes.float()]).float().to(torch.int8)[:, :, 0])
    tail = torch.zeros(n, 0)
    if coded.offsets is not None:
        tail = torch.zeros(n, _whole_tiles(coded.offsets.shape[1]))
        tail[:, : coded.offsets.shape[1]] = coded.offsets
    tail_planes = _planes_of(tail, MOST_TAIL_PLANES)  # float32 values: three at most
    if tail_planes is None:
        return None
    return SplitPlanes(
        planes=_tiles(tail_planes),
        sums_block=0 if coded.offsets is None else coded.block,
        codes=codes,
        scales=tile_scales.contiguous(),
        code_low=low,
    )


def weight_planes(weight: torch.Tensor) -> SplitPlanes | None:
    """A float32 weight that is exactly one or two bfloat16 planes (a bfloat16 or float16
    checkpoint's, loaded in float32); None for others."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % TILE_K:
        return None
    head = weight.detach().reshape(-1)[:4096]  # most float32 weights fail here, cheaply
    if _planes_of(head) is None:
        return None
    return _split(weight.detach().cpu(), sums_block=0)


def gated_planes(gate: SplitPlanes, up: SplitPlanes) -> SplitPlanes | None:
    """gate's and up's column tiles alternating, as split_linear's silu_mul takes them;
    None where their shapes or offsets differ."""
    g, u = gate.planes, up.planes
    if (
        g.shape[:2] != u.shape[:2]
        or gate.sums_block != up.sums_block
        or (gate.codes is None) != (up.codes is None)
    ):
        return None
    planes = max(g.shape[2], u.shape[2])
    g, u = _with_planes(g, planes), _with_planes(u, planes)

    def paired(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if a is None:
            return None
        return torch.stack([a, b], dim=1).reshape(2 * a.shape[0], *a.shape[1:]).contiguous()

    codes, low = _stored(paired(gate.int8_codes(), up.int8_codes()))
    return SplitPlanes(paired(g, u), gate.sums_block, codes, paired(gate.scales, up.scales), low)


def _stored(codes: torch.Tensor | None) -> tuple[torch.Tensor | None, int | None]:
    """int8 codes [..., 32] as SplitPlanes stores them, two a byte where they lie within 16
    values, and their code_low."""
    if codes is None:
        return None, None
    low = _code_low(codes)
    if low is None or int(codes.max()) - low >= 16:
        return codes.contiguous(), low
    offset = (codes.to(torch.int16) - low).to(torch.uint8)
    return (offset[..., :16] | (offset[..., 16:] << 4)).contiguous(), low


def _code_low(codes: torch.Tensor) -> int | None:
    """The least code, where all lie within 32 of it (the kernel's table); else None."""
    if not codes.numel():
        return None
    low, high = int(codes.min()), int(codes.max())
    return low if high - low < 32 else None


def _split(weight: torch.Tensor, sums_block: int) -> SplitPlanes | None:
    planes = _planes_of(weight)
    if planes is None:
        return None
    return SplitPlanes(_tiles(planes), sums_block)


def _planes_of(weight: torch.Tensor, most: int = MOST_PLANES) -> list[torch.Tensor] | None:
    """weight as the fewest bfloat16 planes that sum to it exactly (each the high half of
    what the ones before left), or None where that takes more than `most`."""
    planes, rest = [], weight
    for _ in range(most):
        high = (rest.view(torch.int32) & -65536).view(torch.float32)
        planes.append(high)
        rest = rest - high  # exact: the low bits
        if not rest.any():
            return planes
    return None


def _tiles(planes: list[torch.Tensor]) -> torch.Tensor:
    """[n, k] planes -> bfloat16 [column tiles, k blocks, planes, 16, 32] (zero past n)."""
    n, k = planes[0].shape
    tiles = -(-n // TILE_COLUMNS)
    out = torch.zeros(tiles, k // TILE_K, len(planes), TILE_K // 2, TILE_COLUMNS, 2)
    for j, plane in enumerate(planes):
        padded = torch.zeros(tiles * TILE_COLUMNS, k)
        padded[:n] = plane
        # [tile, column, block, pair, 2] -> [tile, block, pair, column, 2]
        shaped = padded.view(tiles, TILE_COLUMNS, k // TILE_K, TILE_K // 2, 2)
        out[:, :, j] = shaped.permute(0, 2, 3, 1, 4)
    return out.view(tiles, k // TILE_K, len(planes), TILE_K // 2, TILE_K).to(torch.bfloat16)


def _with_planes(planes: torch.Tensor, count: int) -> torch.Tensor:
    missing = count - planes.shape[2]
    if not missing:
        return planes
    zeros = planes.new_zeros(*planes.shape[:2], missing, *planes.shape[3:])
    return torch.cat([planes, zeros], dim=2)


def _whole_tiles(columns: int) -> int:
    return -(-columns // TILE_K) * TILE_K
