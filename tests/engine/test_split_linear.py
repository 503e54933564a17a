"""Split planes: float32 products on AMX tiles, for weights that are one or two bfloat16 planes.

Where the CPU has AMX, products of more rows than the codes' widening serves run on
split_linear (split_planes.py, csrc/split_linear.cpp): x split into three bfloat16
parts, the weight into one or two planes (a GGUF's scale * code, expanded from its
codes in the kernel; a 16-bit checkpoint's values), the offsets as extra inputs.
The results are float32 dot products of the weight's values in another summation
order, so they are held to float32's error bound for a dot product against a float64
reference: a missing part or plane would miss it by orders of magnitude.
"""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model import cpu_kernels
from tandem.engine.model.coded_weight import CodedWeight
from tandem.engine.model.linear import GatedLinears, Linear, pack_linears
from tandem.engine.model.split_planes import (
    SPLIT_ROWS,
    TILE_COLUMNS,
    TILE_K,
    coded_planes,
    gated_planes,
    weight_planes,
)
from tests.engine.test_coded_weight import gguf_coded

OPS = cpu_kernels.load()
needs_amx = pytest.mark.skipif(
    OPS is None or not OPS.amx_ready(),
    reason="needs the kernels built with AMX tiles (Xeons since Sapphire Rapids), the OS's grant",
)
PLANE_TYPES = [gguf.GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]


def coded(n: int, k: int, kind=gguf.GGMLQuantizationType.Q4_1, seed: int = 0):
    """(CodedWeight, its float32 weight) quantised by gguf."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) / 8).astype(np.float32)
    codes, values = gguf_coded(weight, kind)
    return codes, torch.from_numpy(values.astype(np.float32))


def within_float32_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, extra: int = 0) -> None:
    """|y - x @ w.T| <= (K + extra + 2) u (|x| @ |w|.T): float32's bound for a dot product
    of K terms (u = 2^-24), with room for the offsets' extra terms."""
    ref = x.double() @ w.double().T
    bound = (x.shape[1] + extra + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    excess = (y.double() - ref).abs() - bound
    assert excess.max().item() <= 0, f"over float32's bound by {excess.max().item():.3g}"


def split(x: torch.Tensor, planes, n: int, bias=None, silu_mul=False) -> torch.Tensor:
    return OPS.split_linear(x, *planes.args(n, bias, silu_mul))


# ------------------------------------------------------------ planes (no AMX needed)


def unpacked(planes, n: int, k: int) -> torch.Tensor:
    """The weight the planes (or codes) stand for, [n, k] (for codes: scale * code)."""
    t = planes.planes
    if planes.codes is not None:
        codes = planes.int8_codes().float()  # [tiles, blocks, 16 pairs, 32]
        # A row of codes holds 16 columns' pairs: each column's scale twice.
        scales = planes.scales.repeat_interleave(2, dim=-1).view(
            *planes.scales.shape[:2], 1, TILE_K
        )
        t = (codes * scales)[:, :, None]
    summed = t.float().sum(dim=2)  # [tiles, blocks, pairs, columns * 2]
    tiles, blocks = summed.shape[:2]
    shaped = summed.view(tiles, blocks, TILE_K // 2, TILE_COLUMNS, 2).permute(0, 3, 1, 2, 4)
    return shaped.reshape(tiles * TILE_COLUMNS, blocks * TILE_K)[:n, :k]


@pytest.mark.parametrize("kind", PLANE_TYPES, ids=lambda kind: kind.name)
def test_codes_and_their_planes_hold_scale_times_code_and_the_offsets(kind) -> None:
    codes, weight = coded(40, 96, kind)
    planes = coded_planes(codes)
    # 4-bit codes two a byte (16 of them to a tile's row of 32), the others one.
    two_a_byte = kind.name in ("Q4_0", "Q4_1")
    assert planes.codes.dtype == (torch.uint8 if two_a_byte else torch.int8)
    assert planes.codes.shape[-1] == (16 if two_a_byte else 32)
    products = codes.codes.float() * codes.scales.repeat_interleave(32, dim=1)
    assert torch.equal(unpacked(planes, 40, 96), products)
    if codes.offsets is None:
        assert planes.sums_block == 0 and planes.planes.shape[1] == 0
    else:  # the tail's columns: each block's offset
        assert planes.sums_block == 32
        tail = unpacked(type(planes)(planes.planes, 32), 40, 3)
        assert torch.equal(tail, codes.offsets)
        assert torch.equal((products + codes.offsets.repeat_interleave(32, dim=1)), weight)


def test_codes_of_every_type_are_taken_as_they_are_and_odd_inputs_are_not() -> None:
    # The tiles multiply by the codes themselves (int8: exact in bfloat16), whatever the
    # bits of scale * code (Q8_0's reach 19); scales apply to each block's sums.
    for kind in PLANE_TYPES:
        codes, _ = coded(16, 64, kind)
        planes = coded_planes(codes)
        products = codes.codes.float() * codes.scales.repeat_interleave(codes.block, dim=1)
        assert torch.equal(unpacked(planes, 16, 64), products)
    odd = CodedWeight(torch.ones(16, 48, dtype=torch.int8), torch.ones(16, 3), None)
    assert coded_planes(odd) is None  # 48 inputs: not whole tiles of 32


def test_weight_planes_only_for_values_one_or_two_bfloat16_hold() -> None:
    w = torch.randn(20, 64)
    assert weight_planes(w) is None  # float32's 24 bits
    one = weight_planes(w.bfloat16().float())
    two = weight_planes(w.half().float())
    assert one.planes.shape[2] == 1 and two.planes.shape[2] == 2
    assert torch.equal(unpacked(one, 20, 64), w.bfloat16().float())
    assert torch.equal(unpacked(two, 20, 64), w.half().float())
    assert weight_planes(w.bfloat16().float()[:, :48]) is None  # not whole tiles


# ------------------------------------------------------------ the kernel


@needs_amx
@pytest.mark.parametrize("kind", PLANE_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("rows", [1, 33, 47, 64, 100])
@pytest.mark.parametrize("n", [16, 40, 200])
def test_coded_products_are_float32_dot_products_of_the_weights(kind, rows, n) -> None:
    codes, weight = coded(n, 96, kind, seed=rows)
    planes = coded_planes(codes)
    x = torch.randn(rows, 96)
    y = split(x, planes, n)
    within_float32_bound(y, x, weight, extra=3)
    assert (y - F.linear(x, weight)).abs().max() < 1e-4


def test_codes_within_32_values_name_their_least() -> None:
    # The kernel converts such codes through a table of 32 (their low 5 bits), Q8_0's
    # through float32. The tiles' zero padding past the columns counts among the codes.
    lows = {kind.name: coded_planes(coded(40, 64, kind)[0]).code_low for kind in PLANE_TYPES}
    assert lows == {"Q4_0": -8, "Q4_1": 0, "Q5_0": -16, "Q5_1": 0, "Q8_0": None}
    codes = torch.randint(90, 122, (16, 64), dtype=torch.int8)
    codes[0, 0] = 90
    assert coded_planes(CodedWeight(codes, torch.rand(16, 2), None)).code_low == 90
    padded = CodedWeight(codes[:10], torch.rand(10, 2), None)  # zeros past the 10 columns
    assert coded_planes(padded).code_low is None
    gate, up = (coded_planes(coded(32, 64, kind)[0]) for kind in PLANE_TYPES[0:3:2])
    assert gated_planes(gate, up).code_low == -16  # Q4_0's -8..7 and Q5_0's -16..15


@needs_amx
@pytest.mark.parametrize("low", [-128, -20, 0, 90, 100])
def test_products_of_codes_through_the_table_equal_those_through_float32(low) -> None:
    n, k = 208, 192  # 13 whole column tiles: several pairs a thread, the last one alone
    values = torch.arange(low, min(low + 32, 128)).to(torch.int8)
    codes = values[torch.randint(len(values), (n, k))]
    weight = CodedWeight(codes, torch.rand(n, k // 32) / 16, torch.randn(n, k // 32) / 16)
    planes = coded_planes(weight)
    assert planes.code_low == int(codes.min())
    x = torch.randn(70, k)
    y = split(x, planes, n)
    within_float32_bound(y, x, weight.widened(), extra=k // 32)
    assert torch.equal(y, split(x, replace(planes, code_low=None), n))


@needs_amx
@pytest.mark.parametrize("low", [-128, -8, 0, 100, 112])
def test_codes_stored_two_a_byte_multiply_as_the_int8_codes_do(low, threads) -> None:
    """Codes within 16 values (a Q4's) are stored two a byte (half of what a decode step
    reads); the products equal those of the same codes as int8, through the table of 32
    and through float32, bit for bit."""
    n, k = 208, 192
    values = torch.arange(low, low + 16).to(torch.int8)
    codes = values[torch.randint(len(values), (n, k))]
    codes[0, :16] = values  # every value, at both ends of a byte's pair of codes
    codes[1, 16:32] = values.flip(0)
    weight = CodedWeight(codes, torch.rand(n, k // 32) / 16, torch.randn(n, k // 32) / 16)
    planes = coded_planes(weight)
    assert planes.codes.dtype == torch.uint8 and planes.code_low == low
    assert planes.codes.numel() * 2 == planes.int8_codes().numel()
    x = torch.randn(70, k)
    y = split(x, planes, n)
    within_float32_bound(y, x, weight.widened(), extra=k // 32)
    int8 = replace(planes, codes=planes.int8_codes())
    assert torch.equal(y, split(x, int8, n))
    assert torch.equal(y, split(x, replace(int8, code_low=None), n))
    gated = gated_planes(planes, int8)  # paired tile by tile, two a byte again
    assert gated.codes.dtype == torch.uint8
    assert torch.equal(gated.int8_codes()[0::2], int8.codes)
    assert torch.equal(gated.int8_codes()[1::2], int8.codes)


@needs_amx
@pytest.mark.parametrize("kind", [PLANE_TYPES[1], PLANE_TYPES[4]], ids=lambda kind: kind.name)
@pytest.mark.parametrize("n", [40, 2000])
def test_rows_past_the_first_block_multiply_alike(kind, n) -> None:
    """Many rows of a long input: x's parts come in several blocks of rows, and each thread
    converts its codes for the first block (keeping them where they fit its L2, n 40; n 2000
    converts them again for each block); every block's rows hold float32's bound."""
    codes, weight = coded(n, 1536, kind, seed=n)
    x = torch.randn(400, 1536)
    y = split(x, coded_planes(codes), n)  # n 2000: 3.2 MB of output, stored streaming
    within_float32_bound(y, x, weight, extra=48)
    torch.testing.assert_close(y[300:], split(x[300:], coded_planes(codes), n))


@needs_amx
@pytest.mark.parametrize("kind", PLANE_TYPES[:2] + PLANE_TYPES[4:], ids=lambda kind: kind.name)
def test_bias_and_the_gated_product(kind) -> None:
    # Q4_0 and Q8_0 have no offsets (no tail to pair), Q4_1 has; Q8_0's codes take float32.
    gate, g = coded(72, 64, kind, seed=1)
    up, u = coded(72, 64, kind, seed=2)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(50, 64, generator=generator)
    bias = torch.randn(72, generator=generator)
    y = split(x, coded_planes(gate), 72, bias=bias)
    within_float32_bound(y - bias, x, g, extra=2)
    paired = gated_planes(coded_planes(gate), coded_planes(up))
    out = split(x, paired, 72, silu_mul=True)
    expected = F.silu(x.double() @ g.double().T) * (x.double() @ u.double().T)
    # float32 sums of 64 terms ~0.1 (~1e-6 off float64 at worst); a missing part or
    # plane would be ~1e-3 off.
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@needs_amx
@pytest.mark.parametrize(
    "kind", [PLANE_TYPES[1], PLANE_TYPES[4], None], ids=["Q4_1", "Q8_0", "bfloat16"]
)
def test_threads_that_split_many_rows_give_the_bits_of_a_column_split(kind, threads) -> None:
    """From 128 rows a thread the threads split the rows (each reads and writes only its
    own), below it the column pairs: 600 rows in one product equal, bit for bit, the
    same rows in products of 100, plain, gated and rotated."""
    n, k = 256, 192
    if kind is None:
        planes = weight_planes(torch.randn(n, k).bfloat16().float() / 8)
        up = weight_planes(torch.randn(n, k).bfloat16().float() / 8)
    else:
        planes, up = (coded_planes(coded(n, k, kind, seed=s)[0]) for s in (7, 8))
    gated = gated_planes(planes, up)
    x = torch.randn(600, k)
    angles = torch.randn(600, 1, 64)
    cos, sin = angles.cos(), angles.sin()

    def in_pieces(product) -> torch.Tensor:
        return torch.cat([product(slice(i, i + 100)) for i in range(0, 600, 100)])

    assert torch.equal(split(x, planes, n), in_pieces(lambda r: split(x[r], planes, n)))
    assert torch.equal(
        split(x, gated, n, silu_mul=True),
        in_pieces(lambda r: split(x[r], gated, n, silu_mul=True)),
    )
    assert torch.equal(
        rotated(planes, x, n, 3, cos, sin),
        in_pieces(lambda r: rotated(planes, x[r], n, 3, cos[r], sin[r])),
    )


@needs_amx
@pytest.mark.parametrize("kind", [PLANE_TYPES[1], PLANE_TYPES[4]], ids=lambda kind: kind.name)
def test_outputs_past_the_l2_are_stored_streaming_with_the_same_values(kind, threads) -> None:
    """1,200 rows x 1,024 columns (4.9 MB, past two cores' L2 here) stream their tiles
    to memory; 100 rows (0.4 MB) store them plainly: the same values, plain and gated."""
    gate, _ = coded(1024, 128, kind, seed=5)
    up, _ = coded(1024, 128, kind, seed=6)
    x = torch.randn(1200, 128)
    plain = coded_planes(gate)
    assert torch.equal(split(x, plain, 1024)[:100], split(x[:100], plain, 1024))
    paired = gated_planes(plain, coded_planes(up))
    big = split(x, paired, 1024, silu_mul=True)
    assert torch.equal(big[:100], split(x[:100], paired, 1024, silu_mul=True))


@needs_amx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_16_bit_weights_multiply_from_their_planes(dtype) -> None:
    w = torch.randn(48, 128).to(dtype).float()
    x = torch.randn(64, 128)
    y = split(x, weight_planes(w), 48)
    within_float32_bound(y, x, w)


@needs_amx
def test_a_linear_runs_big_products_on_its_planes_and_small_ones_on_its_panels() -> None:
    codes, weight = coded(64, 128, seed=3)
    linear = Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    linear.coded = codes
    pack_linears(linear)
    assert linear.packed.split is not None
    (small, _), (large, _) = linear.packed.kernels()
    assert small.name() == "tandem_cpu::panel_linear" and large.name() == "tandem_cpu::split_linear"
    for rows in (SPLIT_ROWS, SPLIT_ROWS + 1, 200):
        x = torch.randn(rows, 128)
        with torch.no_grad():
            within_float32_bound(linear(x), x, weight, extra=4)


@needs_amx
def test_gated_linears_take_both_weights_planes() -> None:
    gate, up = Linear(64, 40, bias=False), Linear(64, 40, bias=False)
    for linear, seed in ((gate, 4), (up, 5)):
        codes, weight = coded(40, 64, seed=seed)
        with torch.no_grad():
            linear.weight.copy_(weight)
        linear.coded = codes
    gated = GatedLinears.pack(gate, up)
    assert gated.packed.split is not None
    x = torch.randn(80, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        # Two float32 summation orders of 64 terms ~0.1 each: ~1e-6 apart at worst,
        # where a missing part or plane (bfloat16's 2^-8) would be ~1e-3 off.
        torch.testing.assert_close(gated(x), F.silu(gate(x)) * up(x), rtol=1e-5, atol=1e-5)


def rotated(planes, x: torch.Tensor, n: int, heads: int, cos, sin) -> torch.Tensor:
    """The product with its first `heads` heads rotated in the kernel (rope_columns)."""
    d = cos.shape[-1]
    return OPS.split_linear(
        x, *planes.args(n, None, False), cos=cos, sin=sin, rope_columns=heads * d
    )


@needs_amx
def test_empty_products() -> None:
    planes = weight_planes(torch.randn(40, 64).bfloat16().float())
    assert split(torch.randn(0, 64), planes, 40).shape == (0, 40)
    none = weight_planes(torch.zeros(0, 64))
    assert split(torch.randn(5, 64), none, 0).shape == (5, 0)


@needs_amx
def test_bad_arguments_are_named() -> None:
    codes, _ = coded(32, 64)
    planes = coded_planes(codes)
    x = torch.randn(40, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        split(x, planes, 48)
    with pytest.raises(RuntimeError, match="planes cover"):
        split(torch.randn(40, 96), planes, 32)
    with pytest.raises(RuntimeError, match="codes come with their scales"):
        OPS.split_linear(x, planes.planes, 32, 32, None, False, planes.codes, None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        split(x.double(), planes, 32)
    with pytest.raises(RuntimeError, match="silu_mul takes no bias"):
        split(x, gated_planes(planes, planes), 32, bias=torch.zeros(32), silu_mul=True)
    with pytest.raises(RuntimeError, match="code_low comes with codes and is an int8"):
        split(x, replace(planes, code_low=200), 32)
    assert planes.codes.dtype == torch.uint8  # Q4_1's: two a byte, read by code_low
    with pytest.raises(RuntimeError, match="two a byte come with code_low"):
        split(x, replace(planes, code_low=None), 32)
    with pytest.raises(RuntimeError, match=r"uint8 \[tiles, k blocks, 16, 16\] two a byte"):
        split(x, replace(planes, codes=planes.int8_codes().view(torch.uint8)), 32)


@needs_amx
def test_smollm2_decodes_batches_from_the_planes_of_its_codes(smollm2) -> None:
    """Its Q4_1 projections: a step of more than 32 rows multiplies on the tiles and reads
    their codes, two a byte, and scales (~0.75 bytes a weight), not the float32 panels (4)."""
    decoder = smollm2.model.packed_decoder
    _, (large, _) = decoder.layers[0].gated
    assert large.name() == "tandem_cpu::split_linear"
    # Its head dim of 64 is two column pairs: the qkv product rotates q and k itself.
    assert all(layer.fused_rope for layer in decoder.layers)
    assert not any(layer.fused_rope for layer in decoder.float32_only().layers)
    float32 = sum(
        args[0].numel() * 4
        for layer in decoder.layers
        for (_, args), _ in (layer.qkv, layer.o, layer.gated, layer.down)
    )
    assert decoder.weight_bytes(1) == decoder.narrow_bytes()
    assert float32 / 8 < decoder.weight_bytes(64) < float32 / 4  # ~0.75 bytes a weight
