"""Load a llama.cpp GGUF file: config from its metadata, weights dequantised to float32,
and a byte-level BPE tokenizer rebuilt from its vocabulary.

GGUF differs from a Hugging Face checkpoint in three ways that matter here:
- dims are stored fastest-first (ggml's ne[0] is the row length), so every shape
  is reversed relative to torch's;
- llama.cpp's convert_hf_to_gguf.py permutes the rows of q_proj and k_proj so
  each head's rotary pairs are interleaved (its rotary layout); we undo that;
- tied embeddings are written as no `output.weight` at all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tandem.engine.model.coded_weight import CodedWeight
from tandem.engine.model.gguf_container import REQUIRED, GGUFContainer, GGUFTensor
from tandem.engine.model.gguf_tokenizer import gguf_tokenizer
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.model.source import (
    ModelSource,
    check_weight_shapes,
    fingerprint,
    tensor_sample,
)
from tandem.engine.tokenizer import Tokenizer

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# Llama 3.1-style rope scaling arrives as precomputed per-frequency factors.
_ROPE_FREQS = "rope_freqs.weight"


# (Hugging Face name, the GGUF tensor that holds it) for each weight.
_Plan = list[tuple[str, GGUFTensor]]


def load_gguf(path: Path) -> ModelSource:
    """A ModelSource for the GGUF file at `path` (architecture "llama" only)."""
    path = Path(path)
    try:
        reader = GGUFContainer.read(path)
    except (OSError, ValueError, RecursionError) as err:  # arrays of arrays, deeply
        raise ValueError(f"{path}: not a readable GGUF file: {err}") from err
    arch = reader.field("general.architecture", None)
    if arch != "llama":
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; only 'llama'")
    if reader.field("split.count", 1) > 1:
        raise ValueError(f"{path}: split GGUF files are not supported; merge them first")
    if reader.field("llama.expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts GGUFs (e.g. Mixtral) are not supported")

    tensors = {t.name: t for t in reader.tensors}
    tokenizer = gguf_tokenizer(reader, path)
    config = _config(reader, path, tensors, tokenizer)
    plan = _plan(tensors, path)
    check_weight_shapes(config, {hf: _hf_shape(t) for hf, t in plan}, str(path))
    samples = [_sample(tensors[name]) for name in sorted(tensors)]
    return ModelSource(
        config=config,
        tokenizer=tokenizer,
        fingerprint=fingerprint(config, samples),
        origin=f"gguf:{path}",
        # The plan holds views of the reader's memory map: no second metadata parse.
        weight_stream=lambda: _stream(plan, config),
        code_stream=lambda: _codes(plan, config),
    )


def unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's permutation of a q_proj/k_proj weight (rows are outputs).

    llama.cpp writes w.reshape(n_head, 2, d, ...).swapaxes(1, 2): each head's two
    rotary halves interleaved. Reading the rows as (n_head, d, 2) and swapping back
    restores Hugging Face's halves layout.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of rotary pairs")
    shaped = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def _f32(value: float) -> float:
    # Metadata floats are float32: 1e-5 reads back as 9.999999747e-06. Keep the
    # shortest decimal that is the same float32, which is what config.json said.
    return float(str(np.float32(value)))


def _per_layer(value: Any, key: str, path: Path) -> int:
    # Some files give a per-layer list; the Llama model needs one value for all.
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{path}: {key} differs between layers, which is not supported")
        value = value[0]
    return int(value)


def _config(
    reader: GGUFContainer,
    path: Path,
    tensors: dict[str, GGUFTensor],
    tokenizer: Tokenizer | None,
) -> ModelConfig:
    def meta(key: str, default: Any = REQUIRED) -> Any:
        return reader.field(f"llama.{key}", default)

    heads = _per_layer(meta("attention.head_count"), "head_count", path)
    kv_heads = _per_layer(meta("attention.head_count_kv", heads), "head_count_kv", path)
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: key and value head sizes differ, which is not supported")
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: rotary embedding on part of each head is not supported")
    theta = _f32(meta("rope.freq_base", 10000.0))
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    vocab = meta("vocab_size", _hf_shape(tensors["token_embd.weight"])[0])
    context = int(meta("context_length", 2048))
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=_per_layer(meta("feed_forward_length"), "feed_forward_length", path),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_rope_scaling(reader, path, tensors, theta, head_dim),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=tokenizer.bos_token_id if tokenizer else None,
        eos_token_ids=tokenizer.eos_token_ids if tokenizer else (),
        name=path.name,
    )


def _rope_scaling(
    reader: GGUFContainer,
    path: Path,
    tensors: dict[str, GGUFTensor],
    theta: float,
    head_dim: int,
) -> dict[str, Any] | None:
    """Hugging Face's rope_scaling dict for what the metadata (or rope_freqs) says, read
    as llama.cpp reads it: a factor without a type is linear, and older conversions give
    the factor as rope.scale_linear."""
    kind = reader.field("llama.rope.scaling.type", "linear")
    factor = reader.field("llama.rope.scaling.factor", None)
    if factor is None:
        factor = reader.field("llama.rope.scale_linear", 1.0)
    factor = _f32(factor)
    original = reader.field("llama.rope.scaling.original_context_length", None)
    if _ROPE_FREQS in tensors:
        freqs = gguf.quants.dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type)
        return _llama3_scaling(np.asarray(freqs, np.float32).ravel(), theta, head_dim, path)
    if kind in ("none", "") or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn" and original is not None:
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"{path}: rope scaling {kind!r} is not supported")


def _llama3_scaling(freqs: np.ndarray, theta: float, head_dim: int, path: Path) -> dict[str, Any]:
    """The llama3 rope_scaling whose factors llama.cpp precomputed into rope_freqs.

    The file keeps only the factors, so take Meta's published constants, recompute
    the factors as convert_hf_to_gguf.py does, and accept only an exact-enough match.
    """
    factor, low, high, original = float(freqs.max()), 1.0, 4.0, 8192
    expected = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            expected.append(1.0)
        elif wavelen > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if freqs.shape != (head_dim // 2,) or not np.allclose(freqs, expected, rtol=1e-3):
        raise ValueError(f"{path}: {_ROPE_FREQS} is not a llama3 rope scaling we can recognise")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


def _plan(tensors: dict[str, GGUFTensor], path: Path) -> _Plan:
    """(Hugging Face name, GGUF tensor) for each weight, checking each can be dequantised."""
    plan = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf_name = _GLOBAL_NAMES.get(name)
        match = _BLOCK_TENSOR.fullmatch(name)
        if match and match.group(2) in _BLOCK_NAMES:
            hf_name = f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.weight"
        if hf_name is None:
            raise ValueError(f"{path}: tensor {name!r} has no place in a Llama model")
        try:
            # One row is enough to learn whether gguf can dequantise this type.
            gguf.quants.dequantize(tensor.data[:1], tensor.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{path}: tensor {name!r} uses {tensor.tensor_type.name}, "
                f"which the gguf package cannot dequantise"
            ) from None
        plan.append((hf_name, tensor))
    return plan


def _hf_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))


def _codes(plan: _Plan, config: ModelConfig) -> Iterator[tuple[str, CodedWeight]]:
    """The projections' and LM head's codes, where their type is a code form
    (coded_weight.py), in the rows' order after the rotary unpermutation, as _stream
    gives their weights."""
    for hf_name, tensor in plan:
        if hf_name == "model.embed_tokens.weight" and config.tie_word_embeddings:
            hf_name = "lm_head.weight"  # the same tensor, multiplied as the LM head
        elif not hf_name.endswith(("proj.weight", "lm_head.weight")):
            continue  # the norms and untied embeddings are not multiplied by the panel kernel
        shape = _hf_shape(tensor)
        coded = CodedWeight.from_gguf_blocks(tensor.data, tensor.tensor_type.name, shape)
        if coded is None:
            continue
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for kind, n_head in heads.items():
            if hf_name.endswith(f"{kind}.weight"):
                coded = coded.rows(unpermute_rotary(np.arange(shape[0]), n_head))
        yield hf_name, coded


def _stream(plan: _Plan, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for hf_name, tensor in plan:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = np.asarray(weight, dtype=np.float32).reshape(_hf_shape(tensor))
        if hf_name.endswith("q_proj.weight"):
            weight = unpermute_rotary(weight, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = unpermute_rotary(weight, config.num_key_value_heads)
        if not (weight.flags.writeable and weight.flags.c_contiguous):
            # F32 tensors come back as views of the read-only memory map.
            weight = np.array(weight, dtype=np.float32, order="C")
        yield hf_name, torch.from_numpy(weight)


def _sample(tensor: GGUFTensor) -> bytes:
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    return tensor_sample(
        tensor.name,
        tensor.tensor_type.name,
        tensor.shape,
        int(tensor.n_bytes),
        lambda offset, length: raw[offset : offset + length].tobytes(),
    )
