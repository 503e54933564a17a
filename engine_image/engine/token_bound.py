"""The fewest tokens a text can encode to, read from its length alone.

Encoding runs on the engine's stepping thread: a megabyte of prompt takes a
second or more there, and every running request waits for it, only for the
prompt to be refused as too long once its tokens are counted. A token covers
at most as many characters as the vocabulary's longest piece, so a text over
`limit x longest` characters cannot fit `limit` tokens and is refused without
encoding it.

That holds only where the pipeline before the model never makes a text shorter:
no normalizer or pre-tokenizer that drops or merges characters (Unicode
composition, stripping, whitespace splitting that removes the spaces), and no
model that folds a run of unknown characters into one token. For any other
tokenizer the bound is unknown (None) and the text is encoded as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import tokenizers

# Pipeline parts that keep every character (a Replace only where it maps one
# string to another at least as long: SentencePiece's " " -> "▁").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"}


def longest_token_chars(backend: tokenizers.Tokenizer) -> int | None:
    """The most characters of text one token can stand for, or None where the
    tokenizer's pipeline may shrink a text before its model sees it."""
    config = json.loads(backend.to_str())
    if not _keeps_length(config.get("normalizer"), _keeping_normalizer):
        return None
    if not _keeps_length(config.get("pre_tokenizer"), _keeping_pre_tokenizer):
        return None
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("fuse_unk") and not model.get("byte_fallback"):
        return None  # a run of unknown characters is one token
    pieces = backend.get_vocab(with_added_tokens=True)
    return max((len(piece) for piece in pieces), default=None) or None


def fewest_tokens(num_chars: int, longest: int | None) -> int:
    """A lower bound on the tokens of a text of `num_chars` characters (0 if unknown)."""
    return 0 if longest is None else -(-num_chars // longest)


def _keeps_length(part: dict[str, Any] | None, keeps: Callable[[dict[str, Any]], bool]) -> bool:
    if part is None:
        return True
    if part.get("type") == "Sequence":
        inner = part.get("normalizers", part.get("pretokenizers", []))
        return all(_keeps_length(p, keeps) for p in inner)
    return keeps(part)


def _keeping_normalizer(part: dict[str, Any]) -> bool:
    kind = part.get("type")
    if kind == "Prepend":
        return True
    if kind == "Replace":
        pattern = part.get("pattern") or {}
        return "String" in pattern and len(pattern["String"]) <= len(part.get("content", ""))
    return False


def _keeping_pre_tokenizer(part: dict[str, Any]) -> bool:
    kind = part.get("type")
    if kind == "Split":
        return part.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS
