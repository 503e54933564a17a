"""Linear: projections through pre-packed weights equal F.linear's.

The packed path is what every CPU decode step and prefill runs (the loader packs):
float32 on Tandem's panel kernel (csrc/panel_linear.cpp), other dtypes on oneDNN.
F.linear defines the semantics. float32 may differ by summation order only;
bfloat16 runs the same oneDNN kernel as F.linear, so it must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.model import cpu_kernels, linear
from tandem.engine.model.attention import allocate_kv_cache
from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.model.linear import FusedLinears, GatedLinears, Linear, pack_linears
from tandem.engine.model.llama import LlamaForCausalLM
from tandem.engine.model.model_config import ModelConfig
from tests.engine.kernels import needs_kernels

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


def packed_linear(out_features: int, in_features: int, bias: bool = False) -> Linear:
    torch.manual_seed(5)
    layer = Linear(in_features, out_features, bias=bias)
    assert pack_linears(layer) == 1
    return layer


@needs_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_packed_forward_matches_f_linear_for_any_rows_and_layout(bias: bool) -> None:
    layer = packed_linear(40, 96, bias)
    assert layer.packed is not None and layer.packed.panels  # float32: the panel kernel
    gen = torch.Generator().manual_seed(6)
    inputs = [torch.randn(rows, 96, generator=gen) for rows in (0, 1, 5, 64, 333)]
    inputs.append(torch.randn(7, 200, generator=gen)[:, 3:99])  # row-strided view
    inputs.append(torch.randn(2, 3, 96, generator=gen))  # leading batch dims
    with torch.inference_mode():
        for x in inputs:
            got = layer(x)
            assert got.shape == (*x.shape[:-1], 40)
            torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))


PANEL_SHAPES = pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (1, 576, 960),  # a batch-1 decode step: one row, whole panels
        (13, 100, 49),  # a partial tile of rows, a partial last panel
        (64, 1536, 576),  # SmolLM2's down projection: one k block or two (by the L2's size)
        # Several k blocks, each adding to the sums before, wherever a core's L2 holds up
        # to 4 MiB, AVX2's 24-column panels too (panel_linear.cpp's most_k_per_block),
        # and several row blocks.
        (100, 22000, 97),
        # Enough rows that two threads split the rows, not the panels (ROW_SPLIT): a
        # partial last tile on the second thread's share, two k blocks, a partial panel.
        (517, 3000, 50),
    ],
)


def strided_rows(rows: int, features: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, features + 5, generator=gen)[:, 2 : 2 + features]


@needs_kernels
@PANEL_SHAPES
def test_panel_kernel_matches_f_linear(
    rows: int, in_features: int, out_features: int, threads: int
) -> None:
    ops = cpu_kernels.load()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = strided_rows(rows, in_features, gen)
    panels = ops.pack_panels(weight)
    for b in (None, bias):
        got = ops.panel_linear(x, panels, out_features, b)
        expected = F.linear(x, weight, b)
        torch.testing.assert_close(got, expected, atol=1e-4 * in_features**0.5, rtol=1e-4)


@needs_kernels
@PANEL_SHAPES
def test_gated_panel_kernel_matches_silu_of_gate_times_up(
    rows: int, in_features: int, out_features: int, threads: int
) -> None:
    ops = cpu_kernels.load()
    gen = torch.Generator().manual_seed(rows)
    gate, up = (torch.randn(out_features, in_features, generator=gen) for _ in range(2))
    x = strided_rows(rows, in_features, gen) / in_features**0.5  # sums of order 1
    got = ops.panel_linear(x, ops.pack_gated_panels(gate, up), out_features, None, True)
    expected = F.silu(F.linear(x, gate)) * F.linear(x, up)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("threads", [2], indirect=True)
@pytest.mark.parametrize("silu_mul", [False, True])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(silu_mul: bool, threads: int) -> None:
    """A sequence's results must not change with the batch it shares a step with: the
    same rows give the same bits alone, in a decode-sized batch (threads split the
    panels) and in a prefill-sized one (threads split the rows)."""
    ops = cpu_kernels.load()
    gen = torch.Generator().manual_seed(7)
    in_features, out_features = 576, 100
    weights = [torch.randn(out_features, in_features, generator=gen) for _ in range(2)]
    panels = ops.pack_gated_panels(*weights) if silu_mul else ops.pack_panels(weights[0])
    x = strided_rows(1030, in_features, gen) / in_features**0.5
    whole = ops.panel_linear(x, panels, out_features, None, silu_mul)
    for start, stop in ((0, 1), (3, 67), (500, 530), (515, 1030)):
        part = ops.panel_linear(x[start:stop], panels, out_features, None, silu_mul)
        assert torch.equal(part, whole[start:stop]), (start, stop)


@needs_kernels
def test_panel_kernel_edges_and_errors() -> None:
    ops = cpu_kernels.load()
    weight, bias = torch.randn(5, 8), torch.randn(5)
    panels = ops.pack_panels(weight)
    assert ops.panel_linear(torch.randn(0, 8), panels, 5, None).shape == (0, 5)
    no_features = ops.pack_panels(torch.randn(5, 0))  # an empty sum: the bias alone
    assert torch.equal(ops.panel_linear(torch.randn(3, 0), no_features, 5, bias), bias.expand(3, 5))
    with pytest.raises(RuntimeError, match="x has 7 features, the weight 8"):
        ops.panel_linear(torch.randn(2, 7), panels, 5, None)
    too_many = panels.shape[2] + 1
    with pytest.raises(RuntimeError, match=f"out_features {too_many} does not match"):
        ops.panel_linear(torch.randn(2, 8), panels, too_many, None)
    with pytest.raises(RuntimeError, match="panels must come from pack_panels"):
        ops.panel_linear(torch.randn(2, 8), weight, 5, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        ops.panel_linear(torch.randn(2, 8), panels, 5, torch.randn(4))
    with pytest.raises(RuntimeError, match="silu_mul takes no bias"):
        ops.panel_linear(torch.randn(2, 8), panels, 5, bias, True)
    with pytest.raises(RuntimeError, match="gate and up weights of one shape"):
        ops.pack_gated_panels(weight, torch.randn(6, 8))
    with pytest.raises(RuntimeError, match="float32 weight"):
        ops.pack_panels(weight.double())


@needs_onednn
def test_packed_layer_keeps_f_linear_semantics_outside_inference() -> None:
    layer = packed_linear(8, 16)
    # Autograd: F.linear, so gradients flow to the weight.
    x = torch.randn(3, 16)
    layer(x).sum().backward()
    assert layer.weight.grad is not None
    # A wrong width gets F.linear's error naming the shapes, not a oneDNN failure.
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"3x15 and 16x8"):
        layer(torch.randn(3, 15))
    # Another dtype than the packed copy's: F.linear's own error too.
    with torch.inference_mode(), pytest.raises(RuntimeError, match="same dtype"):
        layer(torch.randn(3, 16, dtype=torch.float64))


@needs_onednn
def test_bfloat16_packed_is_bit_for_bit_f_linear() -> None:
    layer = packed_linear(48, 64).to(torch.bfloat16)
    if pack_linears(layer) == 0:
        pytest.skip("this CPU's oneDNN cannot pack bfloat16 weights")
    assert not layer.packed.panels  # the panel kernel is float32 only
    x = torch.randn(9, 64).bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    # A bfloat16 model's gate/up: one oneDNN product, SiLU after (no gated panels).
    model = tiny_model().to(torch.bfloat16)
    assert model.pack_projections() == 5
    assert model.model.layers[0].mlp.gated is None
    assert model.model.layers[0].mlp.gate_up is not None


def tiny_model() -> LlamaForCausalLM:
    config = ModelConfig(
        vocab_size=11,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    state = {n: torch.randn(p.shape) for n, p in model.state_dict().items()}
    del state["lm_head.weight"]  # tied
    model.load_weights(state.items())
    return model


def logits(model: LlamaForCausalLM) -> torch.Tensor:
    caches = allocate_kv_cache(model.config, 4, 4, torch.float32, "cpu")
    meta = AttentionMetadata.build([0], [5], [[2, 0]], 4, True, "cpu")
    with torch.inference_mode():
        return model.compute_logits(model(torch.arange(5), meta.positions, caches, meta))


@needs_onednn
def test_fused_linears_equal_each_linear_alone() -> None:
    torch.manual_seed(7)
    parts = [Linear(32, n, bias=False) for n in (24, 8, 8)]
    fused = FusedLinears.pack(*parts)
    assert fused is not None and fused.sizes == [24, 8, 8]
    x = torch.randn(5, 32)
    with torch.inference_mode():
        assert fused.applies(x)
        outs = fused(x)
        for part, out in zip(parts, outs, strict=True):
            torch.testing.assert_close(out, F.linear(x, part.weight))
    assert not fused.applies(torch.randn(5, 31))  # the separate Linears take over
    assert not fused.applies(x)  # autograd on: the separate Linears too
    assert FusedLinears.pack(Linear(32, 4), Linear(32, 4)) is None  # biases: not fused
    off_cpu = [Linear(32, 4, bias=False, device="meta") for _ in range(2)]
    assert FusedLinears.pack(*off_cpu) is None and pack_linears(off_cpu[0]) == 0
    with pytest.raises(ValueError, match="share their input width"):
        FusedLinears.pack(Linear(32, 4, bias=False), Linear(16, 4, bias=False))


@needs_kernels
def test_gated_linears_equal_silu_of_gate_times_up() -> None:
    torch.manual_seed(8)
    gate, up = Linear(40, 60, bias=False), Linear(40, 60, bias=False)
    gated = GatedLinears.pack(gate, up)
    assert gated is not None and gated.packed.panels and gated.packed.silu_mul
    with torch.inference_mode():
        for x in (torch.randn(5, 40), torch.randn(70, 45)[:, 2:42], torch.randn(2, 3, 40)):
            assert gated.applies(x)
            expected = F.silu(F.linear(x, gate.weight)) * F.linear(x, up.weight)
            torch.testing.assert_close(gated(x), expected)
        assert not gated.applies(torch.randn(5, 39))
    assert not gated.applies(torch.randn(5, 40))  # autograd on: the separate Linears
    # What the panel kernel cannot run packs to None: the callers fuse gate/up instead.
    assert GatedLinears.pack(Linear(40, 60), Linear(40, 60)) is None  # biases
    assert GatedLinears.pack(gate.to(torch.bfloat16), up.to(torch.bfloat16)) is None
    assert GatedLinears.pack(Linear(40, 60, bias=False), Linear(40, 61, bias=False)) is None


@needs_kernels
def test_model_packs_every_projection_and_unpacks_on_new_weights() -> None:
    model = tiny_model()
    # q/k/v fused, gate/up fused with SiLU, o and down alone, and the (tied) head.
    assert model.pack_projections() == 5
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv is not None and mlp.gated is not None and mlp.gate_up is None
    assert attn.q_proj.packed is None  # the fused copy is the only one
    assert attn.o_proj.packed is not None and model.lm_head.packed is not None
    assert "packed" not in str(list(model.state_dict()))  # not a parameter or buffer
    fast = logits(model)
    model.unpack_projections()
    assert attn.qkv is None and mlp.gated is None
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))
    torch.testing.assert_close(fast, logits(model), atol=1e-5, rtol=1e-5)
    # New weights drop the packed copies, which would still multiply by the old ones.
    model.pack_projections()
    model.load_weights((n, torch.randn(p.shape)) for n, p in model.named_parameters())
    assert attn.qkv is None and mlp.gated is None and attn.o_proj.packed is None


def test_nothing_is_packed_when_the_kernels_are_switched_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_DISABLE, "0")
    model = tiny_model()
    assert model.pack_projections() == 0
    assert pack_linears(model) == 0
    assert all(m.packed is None for m in model.modules() if isinstance(m, Linear))


@needs_onednn
def test_packing_is_skipped_with_a_warning_when_the_copies_would_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model()
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}
    need = sum(w.numel() * w.element_size() for w in weights.values())
    monkeypatch.setattr(linear, "available_memory", lambda: 2 * need - 1)
    with pytest.warns(RuntimeWarning, match="not packing the projections"):
        assert model.pack_projections() == 0
    assert model.model.layers[0].self_attn.qkv is None
    monkeypatch.setattr(linear, "available_memory", lambda: 2 * need)
    assert model.pack_projections() == 5
    monkeypatch.setattr(linear, "available_memory", lambda: None)  # unknown: pack
    assert model.pack_projections() == 5


def test_available_memory_reads_the_os() -> None:
    available = linear.available_memory()
    assert available is None or available > 0
