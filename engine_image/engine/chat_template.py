"""Chat templates rendered as transformers renders them: the Jinja environment, the
messages a template is given, and the options of a rendering.

Tokenizer.apply_chat_template and encode_chat render with these; a prompt matches
what the model was trained on only where every piece is transformers' own.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The template a checkpoint names for conversations with tools (transformers' choice).
TOOL_USE = "tool_use"


def template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in (sandboxed)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which changes prompts; transformers' does not.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's text
    with it for training masks (TRL's assistant-only loss); in a prompt it is its body.
    Without it such a template did not compile."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


# Compiled templates a tokenizer keeps: the checkpoint's few, and callers' own.
_MOST_COMPILED = 16


class ChatTemplates:
    """A checkpoint's chat templates, compiled when first used: its default and the
    named others, of which transformers renders "tool_use" for a conversation given
    tools (Hermes 2 Pro's tokenizer_config.json holds both)."""

    def __init__(self, default: str | None, named: Mapping[str, str] | None = None) -> None:
        self.default = default
        self.named = dict(named or {})
        self._compiled: dict[str, jinja2.Template] = {}  # by source

    def for_variables(
        self, variables: Mapping[str, Any], given: str | None = None
    ) -> jinja2.Template:
        """The template to render with `variables` (the conversation's extra ones): the
        caller's own (`given`, a template's source), else the checkpoint's."""
        if given is not None:
            if not isinstance(given, str) or not given.strip():
                raise ValueError(f"chat_template must be a Jinja template, got {given!r:.40}")
            return self._compile(given, "given chat template")
        name = TOOL_USE if variables.get("tools") is not None and TOOL_USE in self.named else None
        source = self.default if name is None else self.named[name]
        if not source:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        what = "chat template" if name is None else f"{name!r} chat template"
        return self._compile(source, f"the model's {what}")

    def _compile(self, source: str, what: str) -> jinja2.Template:
        if (template := self._compiled.get(source)) is not None:
            return template
        try:
            template = template_environment().from_string(source)
        except jinja2.TemplateError as err:
            raise ValueError(f"{what} does not compile: {err}") from err
        if len(self._compiled) >= _MOST_COMPILED:  # callers' own: not kept without end
            self._compiled.pop(next(iter(self._compiled)))
        self._compiled[source] = template
        return template


@dataclass(frozen=True)
class ChatRendering:
    """How a conversation is rendered."""

    add_generation_prompt: bool  # the template opens the assistant's turn
    continue_final_message: bool  # the prompt ends inside the last message, left open
    extra: dict[str, Any]  # more template variables (tools, a template's own flags)
    template: str | None = None  # a template given to render with, not the checkpoint's

    def __post_init__(self) -> None:
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message exclude each other: the "
                "prompt either opens a new assistant turn or goes on with the last message"
            )


class FinalMessageCut:
    """Where a continued final message ends in the rendered prompt, as transformers finds
    it: a tag no message can guess is appended to the message's content, and the prompt
    is cut where the template wrote the tag. (Cutting at the content's last place in the
    text cut inside the template's own tokens where the content also ends them: an
    answer begun "end" ended the prompt in "end<|im_end".)"""

    def __init__(self) -> None:
        # The space after the tag shows whether the template trimmed the content.
        self._tag = f"TANDEM{secrets.token_hex(8)}CONTINUE "

    def tagged(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages, the last one's content (a string) tagged at its end."""
        last = messages[-1]
        return [*messages[:-1], {**last, "content": f"{last['content']}{self._tag}"}]

    def cut(self, text: str) -> str:
        """`text` up to the end of the last message's content: a template that trims the
        content (Llama 3's `| trim`) leaves its trailing whitespace out."""
        at = text.rfind(self._tag.rstrip())
        if at < 0:
            raise ValueError(
                "continue_final_message needs a last message that the chat template writes "
                "into the prompt"
            )
        if text.startswith(self._tag, at):
            return text[:at]
        return text[:at].rstrip()


def checked_messages(messages: Any) -> list[dict[str, Any]]:
    """Copies of the messages, each with a role and string content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} has no 'role' (a non-empty string)")
        if "content" not in message:
            raise ValueError(f"message {i} ({role}) has no 'content'")
        content = message["content"]
        if isinstance(content, list):
            content = _joined_text_parts(content, i)
        elif content is None and not message.get("tool_calls"):
            raise ValueError(f"message {i} ({role}) has no content and no tool_calls")
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"message {i} ({role}): content must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        checked.append({**message, "content": content})
    return checked


def _joined_text_parts(parts: list[Any], index: int) -> str:
    texts = []
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise ValueError(f"message {index}: only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"message {index}: a text part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)  # as the gateway joins them (gateway/messages.py)


def template_options(
    add_generation_prompt: bool, continue_final_message: bool, chat_template_kwargs: Any
) -> dict[str, Any]:
    """encode_chat's keyword arguments for a conversation's options, as vLLM takes them
    (LLM.chat's, a work item's); ValueError naming one that cannot be."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(
            f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}"
        )
    if chat_template_kwargs and "messages" in chat_template_kwargs:
        raise ValueError("chat_template_kwargs cannot set messages: give them as messages")
    if chat_template_kwargs and "chat_template" in chat_template_kwargs:
        # Not a variable: it would replace the template, a client's Jinja run on the engine.
        raise ValueError(
            "chat_template_kwargs cannot set chat_template: the model's own template renders"
        )
    # As vLLM merges them: the kwargs may set the two options too, and win.
    return {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        **(chat_template_kwargs or {}),
    }
