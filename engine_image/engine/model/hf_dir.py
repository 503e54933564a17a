"""Load a local Hugging Face model directory: config.json, safetensors, tokenizer files.

Tensors stream one at a time through safetensors' safe_open, so loading never
holds more than one tensor beyond what the model keeps. Pickled *.bin
checkpoints are refused: unpickling runs code from the file.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from tandem.engine.model.model_config import (
    MISTRAL_CONTEXT,
    MISTRAL_SLIDING_WINDOW,
    ModelConfig,
)
from tandem.engine.model.source import (
    ModelSource,
    check_weight_shapes,
    fingerprint,
    tensor_sample,
)
from tandem.engine.tokenizer import Tokenizer

# Architectures whose checkpoints are a plain Llama decoder under Llama's tensor names.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_dir(path: Path) -> ModelSource:
    """A ModelSource for the Hugging Face model directory at `path`."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not (path / "config.json").is_file():
        raise ValueError(f"{path} holds GGUF files, not a Hugging Face model; pass {ggufs[0]}")
    raw = _read_json(path / "config.json", required=True)
    _check_architecture(raw, path)
    config = ModelConfig.from_hf_dict(raw, name=path.name)
    tokenizer_config = _read_json(path / "tokenizer_config.json", required=False)
    generation = _read_json(path / "generation_config.json", required=False)
    backend = _read_backend(path)
    eos_ids = _eos_ids(config.eos_token_ids, generation, tokenizer_config, backend)
    config = dataclasses.replace(config, eos_token_ids=eos_ids)

    headers = {file: _safetensors_header(file) for file in _weight_files(path)}
    found = {
        name: tuple(info["shape"])
        for header in headers.values()
        for name, info in header.items()
        if not _skipped(name, config)
    }
    check_weight_shapes(config, found, str(path))
    samples = sorted(
        (name, file, info)
        for file, header in headers.items()
        for name, info in header.items()
        if not _skipped(name, config)
    )
    with_samples = [_sample(file, name, info) for name, file, info in samples]
    tokenizer = None
    if backend is not None:
        tokenizer = _tokenizer(path, backend, config, tokenizer_config)
    return ModelSource(
        config=config,
        tokenizer=tokenizer,
        fingerprint=fingerprint(config, with_samples),
        origin=f"hf_dir:{path}",
        weight_stream=lambda: _stream(list(headers), config),
    )


def _check_architecture(raw: dict[str, Any], path: Path) -> None:
    architectures = raw.get("architectures") or []
    # Old configs name no architecture, only a model_type.
    untyped_llama = not architectures and raw.get("model_type") in ("llama", "mistral")
    unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unsupported or not (architectures or untyped_llama):
        found = ", ".join(map(str, architectures)) or "none given"
        raise ValueError(
            f"{path}: architecture {found} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    # Llama-shaped configs can still ask for things the Llama model does not do. Left
    # out, Mistral's window is transformers' default (null: none).
    mistral = raw.get("model_type") == "mistral"
    window = raw.get("sliding_window", MISTRAL_SLIDING_WINDOW if mistral else None)
    context = raw.get("max_position_embeddings")  # a null is left out (ModelConfig)
    if context is None:
        context = MISTRAL_CONTEXT if mistral else 2048
    if window is not None and window < context:
        raise ValueError(
            f"{path}: sliding-window attention (window {window}) is not supported; "
            f"only full attention"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ValueError(f"{path}: {flag} is set; the Llama model here has no biases")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported, only silu")


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ValueError(f"{path.parent}: no {path.name}; not a Hugging Face model directory")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read it as JSON: {err}") from err


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map") or {}
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not there: {', '.join(missing)}")
        if not files:
            raise ValueError(f"{index} has an empty weight_map")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise ValueError(
            f"{path}: only pickled weights (*.bin/*.pt); convert them to safetensors first"
        )
    raise ValueError(f"{path}: no *.safetensors weight files")


def _safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """name -> {"dtype", "shape", "data_offsets"}, read from the file's JSON header only;
    a ValueError naming the file where it is not whole (a truncated copy, a Git LFS
    pointer left by a clone without git-lfs)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if head.startswith(b"version "):  # "version https://git-lfs.github.com/spec/v1"
                raise ValueError(
                    f"{file}: a Git LFS pointer, not the weights: fetch them (git lfs pull)"
                )
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise ValueError(
                    f"{file}: not a safetensors file, or truncated: its header would be "
                    f"{length} bytes, the file is {size}"
                )
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for name, info in header.items():
            # Offsets in the header count from the end of the header.
            info["start"] = 8 + length + info["data_offsets"][0]
            info["end"] = 8 + length + info["data_offsets"][1]
            if info["end"] > size:
                raise ValueError(
                    f"{file}: truncated: tensor {name} ends at byte {info['end']}, "
                    f"the file has {size}"
                )
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not a readable safetensors file: {err}") from err
    except (AttributeError, KeyError, IndexError, TypeError) as err:  # a header of another shape
        raise ValueError(f"{file}: not a safetensors header: {err!r}") from err
    return header


def _skipped(name: str, config: ModelConfig) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # Some tied checkpoints still store a copy of the embeddings as lm_head.
    return name == "lm_head.weight" and config.tie_word_embeddings


def _sample(file: Path, name: str, info: dict[str, Any]) -> bytes:
    start = info["start"]
    with file.open("rb") as f:

        def read(offset: int, length: int) -> bytes:
            f.seek(start + offset)
            return f.read(length)

        return tensor_sample(name, info["dtype"], info["shape"], info["end"] - start, read)


def _stream(files: list[Path], config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if not _skipped(name, config):
                    yield name, f.get_tensor(name)


def _read_backend(path: Path) -> tokenizers.Tokenizer | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # the tokenizers library raises plain Exception subclasses
        raise ValueError(f"{file}: cannot load it: {err}") from err


def _eos_ids(
    from_config: tuple[int, ...],
    generation: dict[str, Any],
    tokenizer_config: dict[str, Any],
    backend: tokenizers.Tokenizer | None,
) -> tuple[int, ...]:
    """Every id that ends generation: config.json's, generation_config.json's, the tokenizer's."""
    ids = list(from_config)
    gen_eos = generation.get("eos_token_id")
    ids += gen_eos if isinstance(gen_eos, list) else ([] if gen_eos is None else [gen_eos])
    eos_text = _token_text(tokenizer_config.get("eos_token"))
    if backend is not None and eos_text is not None:
        eos_id = backend.token_to_id(eos_text)
        if eos_id is not None:
            ids.append(eos_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer(
    path: Path,
    backend: tokenizers.Tokenizer,
    config: ModelConfig,
    tokenizer_config: dict[str, Any],
) -> Tokenizer:
    special = {
        key: text
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (text := _token_text(tokenizer_config.get(key))) is not None
    }
    bos_id = config.bos_token_id
    if "bos_token" in special and backend.token_to_id(special["bos_token"]) is not None:
        bos_id = backend.token_to_id(special["bos_token"])
    default_template, named_templates = _chat_templates(path, tokenizer_config)
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=config.eos_token_ids,
        add_bos_token=bool(tokenizer_config.get("add_bos_token", False)),
        chat_template=default_template,
        named_chat_templates=named_templates,
        special_tokens=special,
    )


def _chat_templates(
    path: Path, tokenizer_config: dict[str, Any]
) -> tuple[str | None, dict[str, str]]:
    """The default chat template and the named others, where transformers finds them:
    chat_template.jinja (beside additional_chat_templates/<name>.jinja),
    chat_template.json, or tokenizer_config's chat_template (a list of named ones)."""
    named: dict[str, str] = {}
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        named = {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))}
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), named
    template = _read_json(path / "chat_template.json", required=False).get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: transformers renders the one called "default", and
        # "tool_use" for a conversation given tools.
        for entry in template:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                named.setdefault(str(entry.get("name")), entry["template"])
        template = named.pop("default", None)
    return (template if isinstance(template, str) else None), named
