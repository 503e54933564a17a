"""LlamaForCausalLM over the paged cache against Hugging Face transformers' Llama."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tandem.engine.model.attention import AttentionMetadata, allocate_kv_cache
from tandem.engine.model.llama import LlamaForCausalLM, rope_inv_freq
from tandem.engine.model.model_config import ModelConfig

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


def test_chunked_prefill_then_decode_matches_hf(pair: Pair) -> None:
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
    config = tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn'"):
        LlamaForCausalLM(config)
    with pytest.raises(ValueError, match="low_freq_factor"):
        rope_inv_freq(tiny_config(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
