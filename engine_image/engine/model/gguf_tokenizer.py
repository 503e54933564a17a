"""A GGUF's tokenizer, rebuilt from its metadata as a `tokenizers` BPE.

Two kinds (`tokenizer.ggml.model`): "gpt2", a byte-level BPE with its merges and
llama.cpp's pre-tokenizer by name (SmolLM2's, Llama 3's); and "llama", the
SentencePiece vocabularies of Llama 2, Mistral and TinyLlama: pieces ("▁the"), one
score each, byte pieces ("<0x0A>") for what no piece spells, and (as converters
write them) no merges. transformers' GGUF loader turns those into its
LlamaTokenizer, a BPE whose merges the scores imply (the file's own where it has
some); this builds the same, so a prompt encodes as the model's own
tokenizer.json would (tests/engine/test_gguf_tokenizer.py compares the two).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from tandem.engine.chat_template import TOOL_USE
from tandem.engine.model.gguf_container import GGUFContainer
from tandem.engine.tokenizer import SENTENCEPIECE_SPACE, Tokenizer

# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's llama-vocab.cpp).
_GPT2_SPLIT = {"default", "gpt2", "mpt", "olmo", "jais"}
# These split every digit apart first (StarCoder-style vocabularies, SmolLM's included).
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_LLAMA3_SPLIT = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"}
# Vocabularies llama.cpp prepends BOS to when the file does not say
# (tokenizer.ggml.add_bos_token): Llama 3's, whose GGUFs mostly carry no such key.
_BOS_BY_DEFAULT = {"llama-bpe", "llama3", "llama-v3", "falcon3"}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # llama.cpp token types


def gguf_tokenizer(reader: GGUFContainer, path: Path) -> Tokenizer | None:
    """The file's tokenizer as a `tokenizers` BPE (byte-level, or SentencePiece's), or
    None if it has none."""
    kind = reader.field("tokenizer.ggml.model", None)
    if kind is None:
        return None
    if kind == "llama":
        return _sentencepiece(reader, path)
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer type {kind!r} is not supported; only 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece)"
        )
    pre = reader.field("tokenizer.ggml.pre", "default")
    tokens = reader.field("tokenizer.ggml.tokens")
    merges = _merge_pairs(reader.field("tokenizer.ggml.merges", []), path) or []
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_SPLIT)
    )
    backend.pre_tokenizer = _pre_tokenizer(pre, path)
    backend.decoder = decoders.ByteLevel()
    types = reader.field("tokenizer.ggml.token_type", [])
    # Control tokens (<|im_start|>) and user-defined ones must match whole, never split;
    # only control tokens are special (dropped by decode(skip_special_tokens=True)).
    backend.add_special_tokens(
        [_added(tokens[i], True) for i, t in enumerate(types) if t == _CONTROL]
    )
    backend.add_tokens(
        [_added(tokens[i], False) for i, t in enumerate(types) if t == _USER_DEFINED]
    )
    return _wrapped(reader, backend, add_bos_by_default=pre in _BOS_BY_DEFAULT)


def _sentencepiece(reader: GGUFContainer, path: Path) -> Tokenizer:
    tokens = reader.field("tokenizer.ggml.tokens")
    scores = reader.field("tokenizer.ggml.scores", None)
    if scores is None:
        raise ValueError(f"{path}: a SentencePiece tokenizer without tokenizer.ggml.scores")
    types = list(reader.field("tokenizer.ggml.token_type", []))
    if not types:  # a file without types: its BOS, EOS and unknown ids are still special
        types = [_NORMAL] * len(tokens)
        for key, kind in (("bos", _CONTROL), ("eos", _CONTROL), ("unknown", _UNKNOWN)):
            index = reader.field(f"tokenizer.ggml.{key}_token_id", None)
            if isinstance(index, int) and 0 <= index < len(tokens):
                types[index] = kind
    # The file's merges where it has any, as transformers reads them (llama.cpp does not).
    merges = _merge_pairs(reader.field("tokenizer.ggml.merges", None), path)
    try:
        backend = sentencepiece_backend(tokens, scores, types, merges)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return _wrapped(reader, backend, add_bos_by_default=True)  # llama.cpp's for SentencePiece


def _merge_pairs(merges: list[str] | None, path: Path) -> list[tuple[str, str]] | None:
    """The file's merges ("a b") as pairs; None where it has none."""
    if merges is None:
        return None
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"{path}: a tokenizer merge is not two tokens separated by a space")
    return pairs  # type: ignore[return-value]


def _wrapped(
    reader: GGUFContainer, backend: tokenizers.Tokenizer, *, add_bos_by_default: bool
) -> Tokenizer:
    """The Tokenizer of `backend`, with the file's BOS, end ids and chat template."""
    bos = reader.field("tokenizer.ggml.bos_token_id", None)
    # End of turn / end of message ids end generation too (Llama 3's <|eot_id|>).
    eos = [reader.field(f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot", "eom")]
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=[i for i in eos if i is not None],
        add_bos_token=bool(reader.field("tokenizer.ggml.add_bos_token", add_bos_by_default)),
        chat_template=reader.field("tokenizer.chat_template", None),
        # llama.cpp's converter writes a checkpoint's named templates beside it.
        named_chat_templates={
            name: template
            for name in (TOOL_USE,)
            if (template := reader.field(f"tokenizer.chat_template.{name}", None)) is not None
        },
    )


def _added(token: str, special: bool) -> tokenizers.AddedToken:
    return tokenizers.AddedToken(token, special=special, normalized=False)


def _pre_tokenizer(pre: str, path: Path) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_SPLIT:
        return byte_level
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_SPLIT:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_GPT2_SPLIT | _DIGIT_SPLIT | _LLAMA3_SPLIT)
    raise ValueError(f"{path}: pre-tokenizer {pre!r} is not supported; known: {', '.join(known)}")


def sentencepiece_backend(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    merges: list[tuple[str, str]] | None = None,
) -> tokenizers.Tokenizer:
    """The vocabulary of `tokens` (their `scores` and llama.cpp token `types`) as a BPE
    with byte fallback, Metaspace pre-tokenizing ("▁" for spaces, one before the
    text), as transformers' LlamaTokenizer is; `merges` the file's, else the ones the
    scores imply."""
    if len(scores) != len(tokens):
        raise ValueError(f"the tokenizer has {len(tokens)} tokens and {len(scores)} scores")
    vocab = {token: i for i, token in enumerate(tokens)}
    if merges is None:
        merges = implied_merges(vocab, dict(zip(tokens, scores, strict=True)))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True)
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SENTENCEPIECE_SPACE, prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SENTENCEPIECE_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    # Control tokens (<s>, </s>) and the unknown one match whole and are special;
    # user-defined ones match whole too.
    special = [tokens[i] for i, kind in enumerate(types) if kind in (_CONTROL, _UNKNOWN)]
    backend.add_special_tokens([tokenizers.AddedToken(t, normalized=False) for t in special])
    own = [tokens[i] for i, kind in enumerate(types) if kind == _USER_DEFINED]
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in own])
    return backend


def implied_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, the piece's score its
    priority (highest first; ties: longer left, then longer right first, then in the
    vocabulary's order), as transformers' generate_merges orders them."""
    found = []
    for piece, score in scores.items():
        local = [
            (piece[:cut], piece[cut:], score)
            for cut in range(1, len(piece))
            if piece[:cut] in vocab and piece[cut:] in vocab
        ]
        found += sorted(local, key=lambda merge: (vocab[merge[0]], vocab[merge[1]]))
    found.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in found]
