"""Tokenizer: text <-> token ids, chat templates, and streaming detokenisation.

Wraps a `tokenizers.Tokenizer` (built from tokenizer.json or from GGUF
metadata) and renders the checkpoint's own Jinja chat template the way Hugging
Face transformers does, so prompts match what the model was trained on.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import tokenizers

from tandem.context_window import prompt_too_long
from tandem.engine.admission import PromptTooLongError
from tandem.engine.chat_template import (
    ChatRendering,
    ChatTemplates,
    FinalMessageCut,
    checked_messages,
)
from tandem.engine.literal_chat import LiteralChat
from tandem.engine.token_bound import fewest_tokens, longest_token_chars

# Texts from this many characters on: their length bounds their tokens, they are
# encoded without the GIL, and the last one's ids are kept.
_LONG_TEXT = 4096

# Decoding "\ufffd" at the end means the last token(s) stopped mid UTF-8 character.
REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder writes for bytes that are no UTF-8
SENTENCEPIECE_SPACE = "\u2581"  # SentencePiece's visible space (its "▁")


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """`special_tokens`: template variables such as bos_token="<s>"; derived from ids if absent.

        `add_bos_token`: prepend BOS on encode(add_special_tokens=True) unless the
        backend's post-processor already did (Llama 3's tokenizer.json does).
        """
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template  # the default one
        self._templates = ChatTemplates(chat_template, named_chat_templates)
        names = dict(special_tokens or {})
        if "bos_token" not in names and bos_token_id is not None:
            names["bos_token"] = backend.id_to_token(bos_token_id) or ""
        if "eos_token" not in names and self.eos_token_ids:
            names["eos_token"] = backend.id_to_token(self.eos_token_ids[0]) or ""
        self._special_tokens = names
        self._token_texts: dict[int, str] = {}  # token_text's, at most the vocabulary
        self._literal_chat: LiteralChat | None = None  # made at the first chat prompt
        self._last_long: tuple[tuple[str, bool], list[int]] | None = None
        self._byte_fallback = backend.token_to_id("<0x00>") is not None
        self._special_ids = frozenset(
            i for i, token in backend.get_added_tokens_decoder().items() if token.special
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (may be below the model's vocab)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))` from the text's length alone, 0 where
        the tokenizer allows none (token_bound.py): a prompt it puts over the limit is
        refused without the seconds a megabyte takes to encode."""
        if len(text) < _LONG_TEXT:
            return 0
        return fewest_tokens(len(text), self._longest_token_chars)

    @functools.cached_property
    def _longest_token_chars(self) -> int | None:
        return longest_token_chars(self._backend)  # read at the first long text

    def encode(
        self, text: str, add_special_tokens: bool = True, *, max_model_len: int | None = None
    ) -> list[int]:
        """`text`'s ids. max_model_len: for a prompt of that context, refused
        (PromptTooLongError) unencoded where its length alone shows it cannot fit."""
        if not isinstance(text, str):
            raise ValueError(f"can only encode a string, got {type(text).__name__}")
        if max_model_len is not None:
            _refuse_unfit(self.fewest_tokens(text), max_model_len)
        if len(text) < _LONG_TEXT:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            ids = self._encode_long(text, add_special_tokens)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def _encode_long(self, text: str, add_special_tokens: bool) -> list[int]:
        """A long text's ids: the last one's remembered (the n choices of one request
        arrive as n prompts of the same text), and encoded by `encode_batch`, which lets
        go of the GIL (`encode` held it: the engine's heartbeat and /metrics stopped)."""
        key = (text, add_special_tokens)
        if self._last_long is None or self._last_long[0] != key:
            encoding = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
            self._last_long = (key, encoding[0].ids)
        return list(self._last_long[1])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; bytes that are no UTF-8 read as Python's `bytes.decode(
        "utf-8", "replace")` reads them, U+FFFD for the bad bytes alone."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if REPLACEMENT_CHARACTER in text and self._byte_fallback and self._backend.decoder:
            # SentencePiece's byte fallback writes U+FFFD for every byte of a run of byte
            # tokens that is not UTF-8 as a whole, the characters in it too ("\xe2" then
            # an emoji: five of them, where Python reads one and the emoji).
            return self._backend.decoder.decode(self._pieces(ids, skip_special_tokens))
        return text

    def _pieces(self, ids: Sequence[int], skip_special_tokens: bool) -> list[str]:
        """The tokens of `ids` as the backend's decoder takes them, each run of byte
        tokens that is no UTF-8 given as its text, read as Python reads it."""
        pieces: list[str] = []
        run: list[str] = []  # byte tokens not yet written
        for token_id in ids:
            if skip_special_tokens and token_id in self._special_ids:
                continue
            piece = self._backend.id_to_token(token_id) or ""
            if _BYTE_FALLBACK.fullmatch(piece):
                run.append(piece)
                continue
            pieces += _byte_run(run)
            run = []
            pieces.append(piece)
        return pieces + _byte_run(run)

    def token_text(self, token_id: int) -> str:
        """One token's own decode, special tokens kept (logprobs name each token so);
        remembered, as a stream asks for the same tokens step after step. A
        SentencePiece token keeps its leading spaces ("▁The" is " The"): decoded alone,
        the decoder strips the space it takes for the text's start, and a run of
        tokens' bytes no longer joined into their text."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.decode([token_id], False)
            piece = self._backend.id_to_token(token_id) or ""
            spaces = len(piece) - len(piece.lstrip(SENTENCEPIECE_SPACE))
            text = " " * max(0, spaces - (len(text) - len(text.lstrip(" ")))) + text
            if not text and (byte := self.fallback_byte(token_id)) is not None:
                text = chr(byte)  # <0x20>: a space the decoder stripped
            self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes, as OpenAI's logprobs give them: a token holding part
        of a multi-byte character (its text is U+FFFD) has that part's bytes, so a
        client can join a run of them into the character."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode()
        if (byte := self.fallback_byte(token_id)) is not None:
            return bytes([byte])
        piece = self._backend.id_to_token(token_id) or ""
        if piece and all(c in _BYTE_LEVEL for c in piece):  # GPT-2's byte-level BPE
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode()

    def fallback_byte(self, token_id: int) -> int | None:
        """The byte a SentencePiece byte-fallback token stands for (`<0xAB>`), else None."""
        found = _BYTE_FALLBACK.fullmatch(self._backend.id_to_token(token_id) or "")
        return None if found is None else int(found.group(1), 16)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`, rendered with the checkpoint's own template.

        continue_final_message: the prompt ends with the last message's content, its
        turn left open for the model to go on with (an assistant's answer begun).
        `extra` reaches the template as variables, as in transformers (e.g. tools);
        chat_template renders instead of the checkpoint's own, as there.
        """
        how = ChatRendering(add_generation_prompt, continue_final_message, extra, chat_template)
        return self._render(checked_messages(messages), how)

    def _render(self, checked: list[dict[str, Any]], how: ChatRendering) -> str:
        """apply_chat_template of messages checked_messages already copied and checked."""
        template = self._templates.for_variables(how.extra, how.template)
        final = FinalMessageCut() if how.continue_final_message else None
        context = {
            # As transformers: set, if to None, whether or not the caller gave them.
            "tools": None,
            "documents": None,
            **self._special_tokens,
            **how.extra,
            "messages": checked if final is None else final.tagged(checked),
            "add_generation_prompt": how.add_generation_prompt,
        }
        try:
            text = template.render(context)  # a dict: any variable name, "self" too
        except (jinja2.TemplateError, TypeError, ValueError) as err:
            raise ValueError(f"chat template failed to render: {err}") from err
        return text if final is None else final.cut(text)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        /,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        max_model_len: int | None = None,
        chat_template: str | None = None,
        **extra: Any,
    ) -> list[int]:
        """The prompt's token ids. A message's text is text: one that holds a control
        token's ("<|im_end|>") gets no control token from it (literal_chat.py).
        max_model_len: as `encode`'s, from the rendered prompt's text (not the messages':
        a template may leave parts of them out, as Qwen3's does earlier turns' reasoning).
        chat_template: a Jinja template to render with instead of the checkpoint's."""
        how = ChatRendering(add_generation_prompt, continue_final_message, extra, chat_template)
        checked = checked_messages(messages)
        if self._literal_chat is None:
            self._literal_chat = LiteralChat(self._backend)
        if where := self._literal_chat.control_text_outside_content(checked):
            raise ValueError(f"{where} holds the text of a special token: only content may")
        if self._literal_chat.holds_control_text(checked):
            return self._literal_chat.encode(checked, lambda marked: self._render(marked, how))
        text = self._render(checked, how)
        # The template writes BOS itself when the model wants one (as transformers assumes).
        return self.encode(text, add_special_tokens=False, max_model_len=max_model_len)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for
    themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_run(pieces: list[str]) -> list[str]:
    """A run of byte tokens (`<0xE2>`), kept where its bytes are UTF-8 (the decoder
    joins them), else their text as Python reads it."""
    raw = bytes(int(piece[3:5], 16) for piece in pieces)
    try:
        raw.decode()
    except UnicodeDecodeError:
        return [raw.decode("utf-8", "replace")]
    return pieces


def _refuse_unfit(fewest: int, max_model_len: int) -> None:
    if (why := prompt_too_long(fewest, max_model_len, at_least=True)) is not None:
        raise PromptTooLongError(why)
