"""Chat prompts whose messages hold control-token text, encoded with that text as text.

A tokenizer matches its special tokens anywhere in the text it encodes, so a message
reading "<|im_end|><|im_start|>system ..." closed its own turn and opened a system
turn of its author's making (transformers and vLLM encode so by default). OpenAI
reads such text as text; so does this module, for message content.

The template is rendered with a marker in place of each such message's content. The
special tokens the template itself wrote split the rendered text into pieces, as a
tokenizer's own special-token matching would; the markers are then replaced by the
contents, and each piece is encoded with special tokens read as text. A prompt
without control-token text in its messages never comes here (Tokenizer.encode_chat),
and a piece encodes as it would have in the whole text: a tokenizer encodes the text
between two special tokens on its own.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import tokenizers

Render = Callable[[list[dict[str, Any]]], str]


class LiteralChat:
    """Encodes rendered chat prompts of one tokenizer with message content as text."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        specials = {
            token.content: token_id
            for token_id, token in backend.get_added_tokens_decoder().items()
            if token.special
        }
        self.special_ids = specials  # special token text -> id
        # Longest first: "<|im_start|>" before a shorter token it begins with.
        names = sorted(specials, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, names))) if names else None
        # Copies that read special tokens as text: for the text's first piece, and for
        # the pieces after a special token (which a "first"-only Metaspace prefix skips).
        self._literal: tuple[tokenizers.Tokenizer, tokenizers.Tokenizer] | None = None
        self._backend = backend

    def holds_control_text(self, messages: Sequence[dict[str, Any]]) -> bool:
        """Whether any message's content holds the text of a special token."""
        return self._specials is not None and any(
            isinstance(m.get("content"), str) and self._specials.search(m["content"])
            for m in messages
        )

    def control_text_outside_content(self, messages: Sequence[dict[str, Any]]) -> str | None:
        """Where a message's field other than its content (a name, the role) holds the
        text of a special token, as "message <i>'s <field>"; None where none does. Only
        contents are read as text: such a name would write its own turns."""
        if self._specials is None:
            return None
        for i, message in enumerate(messages):
            for key, value in message.items():
                if key != "content" and isinstance(value, str) and self._specials.search(value):
                    return f"message {i}'s {key}"
        return None

    def encode(self, messages: list[dict[str, Any]], render: Render) -> list[int]:
        """The prompt `render` makes of `messages` (checked: string contents), each
        content's control-token text encoded as text. ValueError where the template
        does something with a content other than write it once, whole."""
        if self._specials is None:
            raise ValueError("this tokenizer has no special tokens to read as text")
        tag = secrets.token_hex(8)  # no message can guess it
        contents: dict[str, str] = {}  # a marker's number -> the content it stands for
        marked = []
        for i, message in enumerate(messages):
            # Only the contents that hold such text: the template sees every other one
            # as it is (one that skips empty turns, or reads a content, rendered another
            # conversation when every content was a marker).
            if isinstance(message.get("content"), str) and self._specials.search(
                message["content"]
            ):
                # The marker wears the content's surrounding whitespace and stands for
                # the rest: a template that trims (Llama 3's `| trim`) trims it alike.
                text = message["content"]
                core = text.strip()
                lead = text[: len(text) - len(text.lstrip())]
                trail = text[len(lead) + len(core) :]
                contents[str(i)] = core
                message = {**message, "content": f"{lead}TANDEM{tag}M{i}X{trail}"}
            marked.append(message)
        text = render(marked)
        # One pass over the text, however many messages (a count per marker would be
        # quadratic in a long conversation).
        marker = re.compile(f"TANDEM{tag}M([0-9]+)X")

        def restore(piece: str) -> str:
            return marker.sub(lambda m: contents[m.group(1)], piece)

        found = [m.group(1) for m in marker.finditer(text)]
        if len(found) != len(contents) or set(found) != contents.keys():
            raise ValueError(
                "a message holds the text of one of the model's control tokens, and this "
                "model's chat template cannot take it as text: remove it from the message"
            )
        ids: list[int] = []
        start = 0
        for special in self._specials.finditer(text):
            ids += self._piece(restore(text[start : special.start()]), first=start == 0)
            ids.append(self.special_ids[special.group()])
            start = special.end()
        ids += self._piece(restore(text[start:]), first=start == 0)
        return ids

    def _piece(self, text: str, *, first: bool) -> list[int]:
        if not text:
            return []
        if self._literal is None:  # copies: the shared backend's flag is not ours to flip
            spec = self._backend.to_str()
            # SentencePiece's Metaspace puts its space before the text's first piece
            # only; encoded alone, every piece is a first (Llama 2's "<s>[INST]" read
            # "<s>▁[INST]").
            later = spec.replace('"prepend_scheme":"first"', '"prepend_scheme":"never"')
            first_copy = tokenizers.Tokenizer.from_str(spec)
            # One copy where nothing differs (byte-level BPE): a vocabulary's copy is big.
            later_copy = first_copy if later == spec else tokenizers.Tokenizer.from_str(later)
            first_copy.encode_special_tokens = later_copy.encode_special_tokens = True
            self._literal = (first_copy, later_copy)
        return self._literal[0 if first else 1].encode(text, add_special_tokens=False).ids
