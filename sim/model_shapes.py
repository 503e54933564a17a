"""ModelShape: what the cost model needs to know about a model, from its ModelConfig.

Weights read per step, FLOPs per token, KV bytes per token and attention FLOPs
per (query, key) pair, for a dense Llama-family decoder or a mixture of experts
(active against total parameters). Presets: a 70B-class and an 8B Llama and
SmolLM2-135M (the model the CPU calibration runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.model.model_config import SMOLLM2_135M, ModelConfig


@dataclass(frozen=True)
class MoE:
    """Each layer's MLP replaced by `num_experts` experts, `experts_per_token` active."""

    num_experts: int
    experts_per_token: int
    # The intermediate size of one expert (ModelConfig.intermediate_size is ignored).
    expert_intermediate_size: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "expert_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE {name} must be an integer >= 1, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) exceeds num_experts "
                f"({self.num_experts})"
            )

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts a layer reads for `tokens` tokens routed uniformly."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** max(tokens, 0))


@dataclass(frozen=True)
class ModelShape:
    config: ModelConfig
    # Bytes per weight and per KV element (bf16: 2; the CPU engine runs fp32: 4).
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    moe: MoE | None = None

    def __post_init__(self) -> None:
        for name in ("dtype_bytes", "kv_dtype_bytes"):
            if getattr(self, name) not in (1, 2, 4):
                raise ValueError(f"{name} must be 1, 2 or 4 bytes, got {getattr(self, name)!r}")

    @property
    def name(self) -> str:
        return self.config.name

    # ------------------------------------------------------------ parameters

    @property
    def _attention_params(self) -> int:
        c = self.config
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        return c.hidden_size * (q + 2 * kv) + q * c.hidden_size

    @property
    def _mlp_params(self) -> int:
        """One layer's MLP weights that one token multiplies through."""
        c = self.config
        width = self.moe.expert_intermediate_size if self.moe else c.intermediate_size
        per_expert = 3 * c.hidden_size * width
        return per_expert * (self.moe.experts_per_token if self.moe else 1)

    @property
    def lm_head_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def body_params(self) -> int:
        """Weights every token multiplies through, besides the LM head (active experts only)."""
        layers = self.config.num_hidden_layers
        return layers * (self._attention_params + self._mlp_params)

    @property
    def total_params(self) -> int:
        c = self.config
        if self.moe is None:
            return c.num_parameters
        expert = 3 * c.hidden_size * self.moe.expert_intermediate_size
        embed = self.lm_head_params * (1 if c.tie_word_embeddings else 2)
        per_layer = self._attention_params + self.moe.num_experts * expert
        return c.num_hidden_layers * per_layer + embed

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight: what the device must hold."""
        return self.total_params * self.dtype_bytes

    def weight_bytes_read(self, tokens: int) -> float:
        """Bytes of weights one step of `tokens` tokens streams from memory.

        The embedding table is only gathered (a few rows), the LM head is read
        once. A mixture of experts reads the experts its tokens touch.
        """
        c, b = self.config, self.dtype_bytes
        dense = c.num_hidden_layers * self._attention_params + self.lm_head_params
        if self.moe is None:
            return (dense + c.num_hidden_layers * self._mlp_params) * b
        expert = 3 * c.hidden_size * self.moe.expert_intermediate_size
        touched = self.moe.experts_touched(tokens)
        return (dense + c.num_hidden_layers * touched * expert) * b

    # ---------------------------------------------------------------- per token

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token * self.kv_dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all layers: QK^T and PV, 2 FLOPs per MAC."""
        c = self.config
        return 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim


LLAMA_70B = ModelConfig(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    name="llama-70b",
)

LLAMA_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    name="llama-8b",
)

# A Mixtral-8x7B-like mixture of experts, to show active against total parameters.
MOE_8X7B = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=32768,
    name="moe-8x7b",
)

_SHAPES = {
    "llama-70b": ModelShape(LLAMA_70B),
    "llama-8b": ModelShape(LLAMA_8B),
    "smollm2-135m": ModelShape(SMOLLM2_135M, dtype_bytes=4, kv_dtype_bytes=4),
    "moe-8x7b": ModelShape(MOE_8X7B, moe=MoE(8, 2, 14336)),
}


# The engine's own alias for the model it ships (`tandem chat --model smollm2`).
_ALIASES = {"smollm2": "smollm2-135m"}


def model_shape(name: str) -> ModelShape:
    """A preset by name: llama-70b, llama-8b (bf16), smollm2(-135m) (fp32), moe-8x7b (bf16)."""
    try:
        return _SHAPES[_ALIASES.get(name.lower(), name.lower())]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(_SHAPES)}") from None


def model_names() -> tuple[str, ...]:
    return tuple(_SHAPES)
