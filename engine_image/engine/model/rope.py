"""Rotary position embeddings as Hugging Face computes them: the inverse frequencies,
scaled as a checkpoint's rope_scaling asks, and the rotation (rotate_half convention).

The CPU kernels rotate in place (csrc/rotary.h); these define the semantics and run
everywhere else.
"""

from __future__ import annotations

import math

import torch

from tandem.engine.model.model_config import SUPPORTED_ROPE_TYPES, ModelConfig


def rope_inv_freq(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, scaled as the checkpoint asks (as HF)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    # Older configs spell the key "type".
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / _scaling_field(config, scaling, "factor")
    if rope_type == "llama3":
        return _llama3_inv_freq(config, scaling, inv_freq)
    raise ValueError(
        f"model {config.name!r}: rope_type {rope_type!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _scaling_field(config: ModelConfig, scaling: dict, key: str) -> float:
    return float(scaling[key])  # there, and a number > 0: ModelConfig checked


def _llama3_inv_freq(config: ModelConfig, scaling: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short kept, a smooth blend between."""
    factor = _scaling_field(config, scaling, "factor")
    low = _scaling_field(config, scaling, "low_freq_factor")
    high = _scaling_field(config, scaling, "high_freq_factor")
    old_len = _scaling_field(config, scaling, "original_max_position_embeddings")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by cos/sin [T, 1, D] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
