"""LlamaForCausalLM over the paged cache against Hugging Face transformers' Llama.

On CPU the model runs the C++ kernels (cpu_kernels.py) and oneDNN-packed projections
(linear.py) where they are available, packed as the loader packs them; the HF comparisons
also run on the pure-torch path, forced by making cpu_kernels.load() return None
and dropping the packed weights (as TANDEM_CPU_KERNELS=0 or a failed build leaves
a model).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.imports import modules_loaded
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tandem.engine.model import cpu_kernels
from tandem.engine.model.attention import allocate_kv_cache
from tandem.engine.model.attention_metadata import AttentionMetadata
from tandem.engine.model.llama import LlamaForCausalLM, RMSNorm
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.model.rope import apply_rope, rope_inv_freq
from tests.engine.kernels import needs_kernels

BLOCK_SIZE = 4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the tiny head_dim has long, short and blended wavelengths.
    "original_max_position_embeddings": 16,
}
CASES: dict[str, dict[str, Any]] = {
    "mha-untied": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "gqa4-tied": {"num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "gqa4-llama3": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3,
    },
    # head_dim 32: the prefill takes the C++ kernel (the others take SDPA).
    "gqa2-d32": {"num_attention_heads": 2, "num_key_value_heads": 1},
    "linear-tied": {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
}


class Pair:
    """A random HF Llama and ours with its weights, plus a paged cache to run steps in."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        fields = {
            "vocab_size": 397,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "max_position_embeddings": 128,
            "initializer_range": 0.1,  # sharper attention than 0.02, so masks matter
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
            **overrides,
        }
        torch.manual_seed(0)
        self.hf = HFLlama(LlamaConfig(**fields)).eval()
        self.config = ModelConfig.from_hf_dict(self.hf.config.to_dict(), name="tiny-llama")
        self.model = LlamaForCausalLM(self.config)
        self.model.load_weights(self.hf.state_dict().items())
        self.model.pack_projections()  # as load_model does
        self.caches = allocate_kv_cache(self.config, 64, BLOCK_SIZE, torch.float32, "cpu")
        self.free = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables: dict[str, list[int]] = {}

    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return self.hf(torch.tensor([tokens])).logits[0].float()

    def step(self, feeds: list[tuple[str, int, list[int]]], is_prefill: bool) -> torch.Tensor:
        """Run (seq, start, tokens) for each sequence; logits of every fed row."""
        for seq, start, tokens in feeds:
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < start + len(tokens):
                table.append(self.free.pop())
        meta = AttentionMetadata.build(
            [start for _, start, _ in feeds],
            [len(tokens) for _, _, tokens in feeds],
            [self.tables[seq] for seq, _, _ in feeds],
            BLOCK_SIZE,
            is_prefill,
            "cpu",
        )
        ids = torch.tensor([t for _, _, tokens in feeds for t in tokens])
        with torch.inference_mode():
            hidden = self.model(ids, meta.positions, self.caches, meta)
            return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> Pair:
    return Pair(CASES[request.param])


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 397, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_prefill_matches_hf(pair: Pair) -> None:
    pair.tables.clear()
    pair.free = list(range(64))
    prompt = tokens(23, seed=10)
    close(pair.step([("a", 0, prompt)], is_prefill=True), pair.hf_logits(prompt))


@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False])
def test_chunked_prefill_then_decode_matches_hf(
    pair: Pair, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
        pair.model.unpack_projections()
    pair.tables.clear()
    pair.free = torch.randperm(64, generator=torch.Generator().manual_seed(2)).tolist()
    seq_a, seq_b = tokens(30, seed=11), tokens(16, seed=12)
    want_a, want_b = pair.hf_logits(seq_a), pair.hf_logits(seq_b)
    # Two prefill chunks (batched with another prompt), then decode steps.
    got = pair.step([("a", 0, seq_a[:13]), ("b", 0, seq_b[:5])], is_prefill=True)
    close(got, torch.cat([want_a[:13], want_b[:5]]))
    got = pair.step([("a", 13, seq_a[13:21]), ("b", 5, seq_b[5:9])], is_prefill=True)
    close(got, torch.cat([want_a[13:21], want_b[5:9]]))
    for pos_a, pos_b in zip(range(21, 25), range(9, 13), strict=True):
        got = pair.step([("a", pos_a, [seq_a[pos_a]]), ("b", pos_b, [seq_b[pos_b]])], False)
        close(got, torch.stack([want_a[pos_a], want_b[pos_b]]))
    # A verify step: the last token plus drafts, a different number per sequence.
    got = pair.step([("b", 13, seq_b[13:16]), ("a", 25, seq_a[25:30])], is_prefill=False)
    close(got, torch.cat([want_b[13:16], want_a[25:30]]))
    monkeypatch.undo()
    pair.model.pack_projections()  # the module-scoped pair as the other tests expect it


@needs_kernels
def test_the_packed_layers_compute_what_the_modules_compute(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loader's model takes the packed fast path (packed_decoder.py); the modules'
    # kernel path runs the same kernels, so the two agree bit for bit.
    assert pair.model.packed_decoder is not None
    seq_a, seq_b = tokens(30, seed=21), tokens(16, seed=22)
    steps = [
        ([("a", 0, seq_a[:13]), ("b", 0, seq_b[:5])], True),
        ([("a", 13, seq_a[13:21]), ("b", 5, seq_b[5:9])], True),
        ([("a", 21, seq_a[21:22]), ("b", 9, seq_b[9:10])], False),
        ([("b", 10, seq_b[10:14]), ("a", 22, seq_a[22:27])], False),  # drafts to verify
    ]
    runs = []
    for packed in (True, False):
        if not packed:
            monkeypatch.setattr(pair.model, "packed_decoder", None)
        pair.tables.clear()
        pair.free = list(range(64))
        pair.caches = allocate_kv_cache(pair.config, 64, BLOCK_SIZE, torch.float32, "cpu")
        runs.append([pair.step(feeds, is_prefill) for feeds, is_prefill in steps])
    for packed, modules in zip(*runs, strict=True):
        assert torch.equal(packed, modules)


@needs_kernels
def test_only_float32_panels_take_the_packed_layers() -> None:
    # bfloat16 multiplies through oneDNN where this CPU's oneDNN packs it (AVX-512),
    # else through F.linear: never the float32 panels.
    model = LlamaForCausalLM(tiny_config(), dtype=torch.bfloat16)
    model.pack_projections()
    assert model.packed_decoder is None
    model = LlamaForCausalLM(tiny_config())
    assert model.pack_projections()
    assert model.packed_decoder is not None
    model.unpack_projections()
    assert model.packed_decoder is None


def test_greedy_matches_hf_generate(pair: Pair) -> None:
    pair.tables.clear()
    pair.free = list(range(64))[::-1]
    prompt = tokens(9, seed=13)
    with torch.inference_mode():
        hf_out = pair.hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
        )[0, len(prompt) :].tolist()
    ours = [int(pair.step([("g", 0, prompt)], is_prefill=True)[-1].argmax())]
    while len(ours) < 16:
        position = len(prompt) + len(ours) - 1
        ours.append(int(pair.step([("g", position, ours[-1:])], is_prefill=False)[0].argmax()))
    assert ours == hf_out


def tiny_config(**overrides: Any) -> ModelConfig:
    fields = {
        "vocab_size": 11,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        **overrides,
    }
    return ModelConfig(**fields)


def test_parameter_names_are_hf_names() -> None:
    config = tiny_config()
    hf = HFLlama(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
        )
    )
    ours = LlamaForCausalLM(config)
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_load_weights_names_the_bad_tensor() -> None:
    model = LlamaForCausalLM(tiny_config())
    state = {name: torch.randn(p.shape) for name, p in model.state_dict().items()}
    bad_shape = {**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(24, 15)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(24, 15\)"):
        model.load_weights(bad_shape.items())
    unknown = {**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(16)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        model.load_weights(unknown.items())
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"lacks 1 tensors: model\.norm\.weight"):
        model.load_weights(missing.items())
    assert model.load_weights(missing.items(), strict=False) == set(missing)
    extra = {**state, "model.rotary_emb.inv_freq": torch.zeros(4)}
    model.load_weights(extra.items())
    torch.testing.assert_close(model.lm_head.weight, state["lm_head.weight"])


def test_tied_embeddings_load_without_lm_head() -> None:
    model = LlamaForCausalLM(tiny_config(tie_word_embeddings=True))
    state = {
        n: torch.randn(p.shape) for n, p in model.state_dict().items() if n != "lm_head.weight"
    }
    model.load_weights(state.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, state["model.embed_tokens.weight"])


def test_bfloat16_model_runs() -> None:
    config = tiny_config()
    model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    caches = allocate_kv_cache(config, 4, BLOCK_SIZE, torch.bfloat16, "cpu")
    meta = AttentionMetadata.build([0], [5], [[2, 0]], BLOCK_SIZE, True, "cpu")
    with torch.inference_mode():
        hidden = model(torch.arange(5), meta.positions, caches, meta)
        logits = model.compute_logits(hidden)
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert logits.shape == (5, 11)


def test_unsupported_rope_type() -> None:
    # Refused with the config, before a model allocates its weights.
    with pytest.raises(ValueError, match="'yarn'"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq(tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_kernels_match_torch(dtype: torch.dtype) -> None:
    ops = cpu_kernels.load()
    gen = torch.Generator().manual_seed(0)
    rows, hidden, heads, kv_heads, head_dim, inner = 37, 48, 6, 2, 8, 40

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    # Float32 sums in another order: a few ulp; bfloat16 rounds every step alike.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden))
    x, delta = randn(rows, hidden, scale=3.0), randn(rows, hidden)
    with torch.inference_mode():
        torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), **tol)
        residual = x.clone()
        normed = ops.add_rms_norm_(residual, delta, norm.weight, 1e-5)
        assert torch.equal(residual, x + delta)  # the residual stream, updated in place
        torch.testing.assert_close(normed, norm(x + delta), **tol)
        # RoPE on strided views of one fused projection, in place: bit for bit.
        qkv = randn(rows, (heads + 2 * kv_heads) * head_dim)
        q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
        angles = torch.randn(rows, 1, head_dim, generator=gen) * 4
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
        ops.rope_(q, k, cos, sin)
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)
        # SiLU(gate) * up, gate/up as halves of one tensor; large |gate| saturates exp.
        gate_up = randn(rows, 2 * inner, scale=4.0)
        gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -1e-30])
        gate, up = gate_up[:, :inner], gate_up[:, inner:]
        got = ops.silu_mul(gate, up)
        torch.testing.assert_close(
            got, F.silu(gate) * up, atol=1e-6, rtol=1e-5 if tol["rtol"] else 8e-3
        )


@needs_kernels
def test_kernels_need_inference_mode() -> None:
    # No autograd formulas: with grad enabled the model keeps the torch path.
    config = tiny_config()
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    caches = allocate_kv_cache(config, 4, BLOCK_SIZE, torch.float32, "cpu")
    meta = AttentionMetadata.build([0], [5], [[2, 0]], BLOCK_SIZE, True, "cpu")
    hidden = model(torch.arange(5), meta.positions, caches, meta)
    assert hidden.requires_grad
    with torch.inference_mode():
        fast = model(torch.arange(5), meta.positions, caches, meta)
    torch.testing.assert_close(fast, hidden.detach(), atol=1e-5, rtol=1e-5)


def test_loading_a_model_imports_neither_dynamo_nor_sympy() -> None:
    # Every engine process loads one at start: module.to / to_empty / a meta normal_
    # ran Python decompositions that imported both, ~1.5 s of each start.
    loaded = modules_loaded(
        "from tandem.engine.model.loader import load_model; load_model('random:tiny')"
    )
    assert not {"torch._dynamo", "sympy"} & set(loaded)
