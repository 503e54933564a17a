"""ModelSource: a model's config, weights and tokenizer, whatever file they came from.

`loader.resolve_model(spec)` turns what a user typed (a Hugging Face directory, a
.gguf file, the alias "smollm2", or "random:<size>") into a ModelSource, read by
hf_dir.py, gguf_file.py or random_model.py. Every source yields its tensors under
Hugging Face's LlamaForCausalLM state_dict names, so the model has one
`load_weights` whatever the file format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from tandem.engine.model.coded_weight import CodedWeight
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.tokenizer import Tokenizer

# How many bytes from each end of each tensor go into a fingerprint.
SAMPLE_BYTES = 4096


@dataclass(frozen=True)
class ModelSource:
    """What the engine needs from a model: shape, weights, tokenizer and identity.

    `fingerprint` is a sha256 hex digest of the config (all fields but `name`, so
    the same model at two paths matches) and, for each tensor in name order, its
    name, stored dtype, shape and the first and last SAMPLE_BYTES of its stored
    bytes. It reads a few KiB per tensor, so it is cheap; it tells different
    checkpoints apart, not two copies that differ in one byte mid-tensor.
    """

    config: ModelConfig
    tokenizer: Tokenizer | None
    fingerprint: str
    # Where it came from, for messages: "hf_dir:<path>", "gguf:<path>", "random:tiny".
    origin: str
    # Opens a fresh stream each call, so weights can be loaded more than once.
    weight_stream: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    # The quantised forms of the weights a checkpoint stores quantised (coded_weight.py),
    # by the same names; None where it stores none.
    code_stream: Callable[[], Iterator[tuple[str, CodedWeight]]] | None = field(
        default=None, repr=False
    )

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) pairs, one tensor in memory at a time.

        Tensors keep their stored dtype (GGUF ones are dequantised to float32).
        lm_head.weight is absent when the config ties it to the embeddings.
        """
        return self.weight_stream()

    def iter_codes(self) -> Iterator[tuple[str, CodedWeight]]:
        """(Hugging Face name, CodedWeight) for each weight stored in a code form the
        panel kernel multiplies by exactly (e.g. a GGUF's Q4_1 projections)."""
        return self.code_stream() if self.code_stream is not None else iter(())


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint holds, under Hugging Face names, with its shape."""
    h, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weight_shapes(config: ModelConfig, found: dict[str, tuple[int, ...]], where: str) -> None:
    """ValueError unless `found` holds exactly the tensors `config` implies, shapes included."""
    expected = hf_weight_shapes(config)
    problems = [f"missing {n}" for n in expected if n not in found]
    problems += [f"unexpected {n}" for n in found if n not in expected]
    problems += [
        f"{n} has shape {list(found[n])}, the config implies {list(shape)}"
        for n, shape in expected.items()
        if n in found and tuple(found[n]) != shape
    ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(
            f"{where}: the tensors do not fit a Llama model of this config: "
            + "; ".join(problems[:5])
            + more
        )


def tensor_sample(
    name: str, dtype: str, shape: Iterable[int], nbytes: int, read: Callable[[int, int], bytes]
) -> bytes:
    """One tensor's part of a fingerprint: its identity and both ends of its stored bytes.

    `read(offset, length)` returns that slice of the tensor's `nbytes` stored bytes.
    """
    head = read(0, min(nbytes, SAMPLE_BYTES))
    tail = read(nbytes - SAMPLE_BYTES, SAMPLE_BYTES) if nbytes > SAMPLE_BYTES else b""
    ident = json.dumps([name, dtype, [int(d) for d in shape], nbytes]).encode()
    return ident + head + tail


def fingerprint(config: ModelConfig, samples: Iterable[bytes]) -> str:
    """sha256 hex digest of the config (without its name) and the samples, in the given order."""
    fields = dataclasses.asdict(config)
    fields.pop("name")
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    for sample in samples:
        # Length-prefixed so no two different sample lists hash alike.
        digest.update(len(sample).to_bytes(8, "little"))
        digest.update(sample)
    return digest.hexdigest()
