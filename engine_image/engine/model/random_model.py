"""Random Llama models for tests: fixed shapes, seeded weights, a byte-level tokenizer.

Each tensor comes from its own torch.Generator seeded from (seed, tensor name),
so two processes (a prefill pod and a decode pod) build identical weights, in
any order, without sharing a file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers

from tandem.engine.model.model_config import RANDOM_POSITIONS, RANDOM_SHAPES, ModelConfig
from tandem.engine.model.model_spec import spec_problem
from tandem.engine.model.source import (
    ModelSource,
    fingerprint,
    hf_weight_shapes,
    tensor_sample,
)
from tandem.engine.tokenizer import Tokenizer

# Bump when the way weights are drawn changes, so fingerprints change with them.
_INIT_VERSION = "normal-v1"

_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_BOS_ID, _EOS_ID = 1, 2
# Merges grow words from these letters, most common first.
_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def random_config(size: str) -> ModelConfig:
    if (problem := spec_problem(f"random:{size}")) is not None:
        raise ValueError(problem)
    return ModelConfig(
        **RANDOM_SHAPES[size],
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=RANDOM_POSITIONS,
        bos_token_id=_BOS_ID,
        eos_token_ids=(_EOS_ID,),
        name=f"random:{size}",
    )


def random_weights(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """float32 weights under Hugging Face names, the same for the same (config, seed)."""
    for name, shape in hf_weight_shapes(config).items():
        values = torch.randn(shape, generator=_generator(seed, name), dtype=torch.float32)
        if name.endswith("norm.weight"):
            # Around 1 but not 1, so a model that ignores its norm weights fails tests.
            yield name, 1.0 + 0.1 * values
        elif name == "model.embed_tokens.weight":
            yield name, values
        else:
            # 1/sqrt(fan_in) keeps activations near unit scale through the layers.
            yield name, values / shape[-1] ** 0.5


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly `vocab_size` tokens: 3 specials, 256 bytes, then merges.

    The merges are made up (space+letter, then letter runs), so any text encodes
    and every id the model can sample decodes to something.
    """
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = len(_SPECIAL_TOKENS) + len(byte_chars)
    if vocab_size < base:
        raise ValueError(f"a byte-level tokenizer needs a vocab of at least {base}")
    vocab = {token: i for i, token in enumerate([*_SPECIAL_TOKENS, *byte_chars])}
    merges: list[tuple[str, str]] = []
    grow = ["Ġ", *_LETTERS]  # "Ġ" is how ByteLevel spells a space
    for left in grow:
        if len(vocab) >= vocab_size:
            break
        for letter in _LETTERS:
            if len(vocab) >= vocab_size:
                break
            if left + letter not in vocab:
                merges.append((left, letter))
                vocab[left + letter] = len(vocab)
                grow.append(left + letter)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS]
    )
    return Tokenizer(
        backend,
        bos_token_id=_BOS_ID,
        eos_token_ids=(_EOS_ID,),
        chat_template=_CHAT_TEMPLATE,
    )


def random_source(size: str, *, seed: int = 0) -> ModelSource:
    """The model 'random:<size>'."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"model 'random:{size}': seed must be an integer, got {seed!r}")
    config = random_config(size)
    # Weights are not stored anywhere, so the fingerprint samples how they are drawn:
    # the seed, the init scheme, and a probe of the generator (torch could change it).
    probe = torch.randn(64, generator=_generator(seed, "<probe>")).numpy().tobytes()
    identity = json.dumps({"init": _INIT_VERSION, "seed": seed}).encode()
    return ModelSource(
        config=config,
        tokenizer=byte_level_tokenizer(config.vocab_size),
        fingerprint=fingerprint(
            config,
            [identity, tensor_sample("<probe>", "float32", (64,), len(probe), _slicer(probe))],
        ),
        origin=f"random:{size}",
        weight_stream=lambda: random_weights(config, seed),
    )


def _slicer(data: bytes) -> Callable[[int, int], bytes]:
    return lambda offset, length: data[offset : offset + length]


def _generator(seed: int, name: str) -> torch.Generator:
    # hashlib, not hash(): Python's string hash differs from process to process.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
