"""Coded weights: a quantised checkpoint's codes multiply exactly as its float32 weights.

The packed projections of a GGUF model keep the file's codes beside the float32
panels, and the panel kernel widens them to the same float32 values where a product
has few rows (coded_weight.py, csrc/panel_linear.cpp). Nothing may change but the
speed: the codes must widen to the loader's weights bit for bit, and a product over
them must give the float32 panels' bits.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.model import cpu_kernels
from tandem.engine.model.coded_weight import (
    CodedWeight,
    narrow_panels,
    pack_coded,
    pack_gated_coded,
)
from tandem.engine.model.linear import Linear, pack_linears
from tandem.engine.model.loader import load_model, resolve_model
from tests.engine.kernels import needs_kernels
from tests.engine.test_model_sources import _save_hf_dir, write_llama_gguf

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
CODE_TYPES = [gguf.GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")]


def gguf_coded(
    weight: np.ndarray, kind: gguf.GGMLQuantizationType
) -> tuple[CodedWeight, np.ndarray]:
    """weight quantised by gguf itself: (our codes of the blocks, gguf's dequantisation)."""
    raw = gguf.quants.quantize(weight, kind)
    coded = CodedWeight.from_gguf_blocks(raw, kind.name, weight.shape)
    assert coded is not None
    return coded, gguf.quants.dequantize(raw, kind).reshape(weight.shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda kind: kind.name)
def test_codes_widen_to_what_gguf_dequantises_bit_for_bit(kind) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((37, 96)).astype(np.float32)
    weight[3] = 0.0  # all-zero blocks: a zero scale
    weight[5, :32] = -1e-3  # a constant negative block
    coded, expected = gguf_coded(weight, kind)
    assert coded.block == 32 and (coded.offsets is None) == (kind.name[-1] == "0")
    assert torch.equal(bits(coded.widened()), bits(torch.from_numpy(expected)))
    assert coded.matches(torch.from_numpy(expected))


def test_other_gguf_types_have_no_codes_here() -> None:
    weight = np.ones((2, 256), np.float32)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.F16)
    assert CodedWeight.from_gguf_blocks(raw, "F16", weight.shape) is None
    q4_k = np.zeros((2, 144), np.uint8)  # one 256-weight super-block a row: 4.5 bits a weight
    assert CodedWeight.from_gguf_blocks(q4_k, "Q4_K", weight.shape) is None


def test_matches_refuses_any_other_value_even_the_sign_of_a_zero() -> None:
    weight = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    weight[2, :32] = 0.0  # a block of zeros: widened to +0
    coded, expected = gguf_coded(weight, Q4_1)
    exact = torch.from_numpy(expected)
    assert coded.matches(exact)
    nudged = exact.clone()
    nudged[1, 7] = torch.nextafter(nudged[1, 7], torch.tensor(np.inf))
    negative_zero = exact.clone()
    negative_zero[2, 0] = -0.0
    for other in (nudged, negative_zero, exact.double(), exact[:, :32]):
        assert not coded.matches(other)


def test_codes_whose_products_float32_rounds_are_refused() -> None:
    """The kernel fuses scale * code + offset into one FMA, which rounds once: exact where
    the product needs no rounding (float16 scales times 8-bit codes), not otherwise."""
    codes = torch.full((1, 32), 3, dtype=torch.int8)
    thirds = CodedWeight(codes, torch.tensor([[1 / 3]]), torch.tensor([[0.1]]))
    assert not thirds.matches(thirds.widened())
    halves = CodedWeight(codes, torch.tensor([[0.5]]), torch.tensor([[0.1]]))
    assert halves.matches(halves.widened())


def test_rows_reorders_codes_scales_and_offsets_together() -> None:
    coded, expected = gguf_coded(
        np.random.default_rng(2).standard_normal((6, 64)).astype(np.float32), Q4_1
    )
    order = np.array([5, 0, 3, 1, 4, 2])
    assert torch.equal(bits(coded.rows(order).widened()), bits(torch.from_numpy(expected[order])))


def test_bad_code_forms_are_named() -> None:
    codes = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="codes must be int8"):
        CodedWeight(codes.float(), torch.ones(4, 2), None)
    with pytest.raises(ValueError, match="do not split into 3 blocks"):
        CodedWeight(codes, torch.ones(4, 3), None)
    with pytest.raises(ValueError, match="offsets must be float32 and shaped as the scales"):
        CodedWeight(codes, torch.ones(4, 2), torch.ones(4, 1))


def random_coded(
    out_features: int, in_features: int, gen: torch.Generator, offsets: bool, signed4: bool = False
) -> CodedWeight:
    """Q4_1-like codes (0..15, float16 scales and offsets), Q8_0-like (-128..127, no
    offset) or, signed4, Q4_0-like (-8..7, no offset)."""
    blocks = in_features // 32
    scales = (torch.rand(out_features, blocks, generator=gen) / 50).half().float()
    if signed4:
        codes = torch.randint(-8, 8, (out_features, in_features), generator=gen, dtype=torch.int8)
        return CodedWeight(codes, scales, None)
    if offsets:
        codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int8)
        shifts = (-torch.rand(out_features, blocks, generator=gen) / 10).half().float()
        return CodedWeight(codes, scales, shifts)
    codes = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    return CodedWeight(codes, scales / 16, None)


def coded_args(panels) -> tuple:
    return (panels.codes, panels.scales, panels.offsets, panels.code_low)


@needs_kernels
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (1, 576, 960),  # a batch-1 decode step
        (13, 96, 49),  # a partial tile of rows, a partial last panel
        (32, 1536, 576),  # SmolLM2's down projection, the most rows widened
        (20, 22016, 97),  # several k blocks, each adding to the sums before
        (64, 576, 100),  # more rows than are widened for: the float32 panels serve
        (517, 3008, 50),  # threads split the rows: the float32 panels again
    ],
)
@pytest.mark.parametrize(
    ("offsets", "signed4"),
    [(True, False), (False, False), (False, True)],
    ids=["offsets", "scales-only", "signed-4-bit"],
)
def test_coded_panels_give_the_float32_panels_bits(
    rows: int, in_features: int, out_features: int, offsets: bool, signed4: bool, threads: int
) -> None:
    """4-bit codes (Q4_1-like with offsets, Q4_0-like signed) are stored two a byte, 8-bit
    ones one; widened, both give the float32 panels' bits."""
    ops = cpu_kernels.load()
    gen = torch.Generator().manual_seed(rows)
    coded = random_coded(out_features, in_features, gen, offsets, signed4)
    weight = coded.widened()
    x = torch.randn(rows, in_features + 3, generator=gen)[:, 1 : 1 + in_features] / 8
    bias = torch.randn(out_features, generator=gen)
    panels = ops.pack_panels(weight)
    narrow = pack_coded(coded, ops)
    assert narrow.codes.dtype == (torch.uint8 if offsets or signed4 else torch.int8)
    assert torch.equal(narrow.int8_codes(), ops.pack_panels(coded.codes))
    for b in (None, bias):
        expected = ops.panel_linear(x, panels, out_features, b)
        got = ops.panel_linear(x, panels, out_features, b, False, *coded_args(narrow))
        assert torch.equal(bits(got), bits(expected))
    up = random_coded(out_features, in_features, gen, offsets, signed4)
    gated = ops.pack_gated_panels(weight, up.widened())
    expected = ops.panel_linear(x, gated, out_features, None, True)
    coded_gated = pack_gated_coded(coded, up, ops)
    got = ops.panel_linear(x, gated, out_features, None, True, *coded_args(coded_gated))
    assert torch.equal(bits(got), bits(expected))


@needs_kernels
def test_panel_linear_names_bad_codes() -> None:
    ops = cpu_kernels.load()
    coded = random_coded(5, 64, torch.Generator().manual_seed(0), True)
    panels = ops.pack_panels(coded.widened())
    c = pack_coded(coded, ops)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="codes come with scales"):
        ops.panel_linear(x, panels, 5, None, False, c.codes)
    with pytest.raises(RuntimeError, match="codes must be panels shaped as the float32 ones"):
        ops.panel_linear(x, panels, 5, None, False, c.int8_codes()[:, :32], c.scales, c.offsets)
    with pytest.raises(RuntimeError, match="scales must be float32"):
        ops.panel_linear(x, panels, 5, None, False, c.codes, c.scales.double(), c.offsets, 0)
    with pytest.raises(RuntimeError, match="offsets must be shaped as the scales"):
        ops.panel_linear(x, panels, 5, None, False, c.codes, c.scales, c.offsets[:, :1], 0)
    # Q4_1-like codes: two a byte, which take their least code and half the rows.
    assert c.codes.dtype == torch.uint8 and c.code_low == 0
    with pytest.raises(RuntimeError, match="code_low comes with codes two a byte"):
        ops.panel_linear(x, panels, 5, None, False, c.codes, c.scales, c.offsets)
    with pytest.raises(RuntimeError, match="code_low comes with codes two a byte"):
        ops.panel_linear(x, panels, 5, None, False, c.int8_codes(), c.scales, c.offsets, 0)
    with pytest.raises(RuntimeError, match="two a byte: half the rows"):
        ops.panel_linear(x, panels, 5, None, False, c.codes[:, :16], c.scales, c.offsets, 0)


@needs_kernels
def test_a_linear_packs_its_codes_only_where_they_give_its_weight() -> None:
    coded = random_coded(40, 64, torch.Generator().manual_seed(3), True)
    layer = Linear(64, 40, bias=False)
    with torch.no_grad():
        layer.weight.copy_(coded.widened())
    layer.coded = coded
    assert pack_linears(layer) == 1 and layer.packed.narrow is not None
    with torch.no_grad():
        layer.weight[0, 0] += 1.0  # the weights changed since the codes came
    assert pack_linears(layer) == 1 and layer.packed.narrow is None  # float32 panels alone


@needs_kernels
def test_a_gguf_model_packs_its_quantised_projections_coded(tmp_path: Path) -> None:
    """q_proj and k_proj come out of the file un-permuted (gguf_file.py): their codes must
    be reordered the same way, or they would not match and the model would fall back."""
    source = resolve_model("random:tiny")
    qtypes = {name: Q4_1 for name, _ in source.iter_weights() if name.endswith("proj.weight")}
    qtypes["model.layers.0.mlp.down_proj.weight"] = Q8_0
    qtypes["lm_head.weight"] = Q8_0  # untied here: the file's output.weight
    path = tmp_path / "model.gguf"
    write_llama_gguf(path, source, qtypes=qtypes)
    loaded = load_model(str(path), dtype="float32", device="cpu")
    for layer in loaded.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for packed in (attn.qkv.packed, attn.o_proj.packed, mlp.gated.packed, mlp.down_proj.packed):
            assert packed.narrow is not None
    assert loaded.model.lm_head.packed.narrow is not None
    decoder = loaded.model.packed_decoder
    assert decoder is not None
    # A 4-bit code half a byte (the Q8_0 layer's a byte) and two float32 a block of 32:
    # under a quarter of the panels.
    products = [
        kernels[0][1]  # panel_linear's arguments: the float32 panels first
        for layer in decoder.layers
        for kernels in (layer.qkv, layer.o, layer.gated, layer.down)
    ]
    float32_bytes = sum(args[0].numel() * 4 for args in products)
    assert float32_bytes / 8 < decoder.narrow_bytes() < float32_bytes / 4
    # And the text does not depend on them: the same tokens once the codes are dropped.
    prompts = [[1, 5, 9, 2], [7, 3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(loaded, num_kv_blocks=16)
    with_codes = [
        out.token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert all(m.coded is None for m in loaded.model.modules() if isinstance(m, Linear))
    loaded.model.pack_projections()  # the codes went into the first packing only
    assert loaded.model.model.layers[0].mlp.gated.packed.narrow is None
    assert loaded.model.packed_decoder.narrow_bytes() is None
    without = [
        out.token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)
    ]
    assert with_codes == without


# --- 16-bit panels: a bfloat16 or float16 checkpoint loaded in float32 -------------------


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"), [(1, 576, 960), (13, 100, 49), (32, 1536, 97)]
)
def test_16_bit_panels_give_the_float32_panels_bits(
    dtype: torch.dtype, rows: int, in_features: int, out_features: int, threads: int
) -> None:
    ops = cpu_kernels.load()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype).float()
    up = torch.randn(out_features, in_features, generator=gen).to(dtype).float()
    x = torch.randn(rows, in_features, generator=gen) / 8
    for panels, silu_mul in (
        (ops.pack_panels(weight), False),
        (ops.pack_gated_panels(weight, up), True),
    ):
        narrow = narrow_panels(panels)
        assert narrow is not None and narrow.codes.dtype == dtype and narrow.scales is None
        expected = ops.panel_linear(x, panels, out_features, None, silu_mul)
        got = ops.panel_linear(x, panels, out_features, None, silu_mul, narrow.codes, None, None)
        assert torch.equal(bits(got), bits(expected))


def test_narrow_panels_only_where_every_value_survives() -> None:
    gen = torch.Generator().manual_seed(0)
    assert narrow_panels(torch.randn(2, 64, 48, generator=gen)) is None  # float32 values
    halves = torch.randn(2, 64, 48, generator=gen).half().float()
    halves[0, 0, 0] = 2.0**-20  # a float16 subnormal: bfloat16 lacks its bits
    assert narrow_panels(halves).codes.dtype == torch.float16
    brains = torch.randn(2, 64, 48, generator=gen).bfloat16().float()
    brains[1, 2, 3] = torch.tensor(1e30).bfloat16().float()  # beyond float16's range
    assert narrow_panels(brains).codes.dtype == torch.bfloat16
    brains[1, 2, 4] = -0.0
    assert torch.equal(bits(narrow_panels(brains).codes.float()), bits(brains))
    brains[1, 63, 47] = 0.1  # past the first values looked at alone: the whole is checked
    assert narrow_panels(brains) is None


@needs_kernels
def test_a_bfloat16_checkpoint_loaded_in_float32_multiplies_in_16_bits(tmp_path: Path) -> None:
    config = resolve_model("random:tiny").config
    _save_hf_dir(tmp_path, config, torch.bfloat16)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    layer = loaded.model.model.layers[0]
    for packed in (layer.self_attn.qkv.packed, layer.mlp.gated.packed, layer.mlp.down_proj.packed):
        assert packed.narrow is not None and packed.narrow.codes.dtype == torch.bfloat16
    prompts = [[1, 5, 9, 2], [7, 3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(loaded, num_kv_blocks=16)
    narrow = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    # The float32 panels alone:
    loaded.model.packed_decoder = loaded.model.packed_decoder.float32_only()
    wide = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert narrow == wide


@needs_kernels
def test_smollm2_multiplies_its_q4_1_projections_and_q8_0_head_from_their_codes(smollm2) -> None:
    """The tied head's codes are the embedding's (token_embd, Q8_0)."""
    model = smollm2.model
    assert model.lm_head.packed.narrow.codes.dtype == torch.int8
    assert model.packed_decoder.narrow_bytes() is not None
