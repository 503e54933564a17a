"""A chat request's messages as the engine takes them, each field checked for its role.

A message may have the fields OpenAI's message schemas define, each only in its
role's messages; those Tandem cannot serve (a past answer's tool calls, audio)
pass only empty, as clients that send every field or append OpenAI's own reply
have them. Text must be valid Unicode for the engine's tokenizer.
"""

from __future__ import annotations

import re
from typing import Any

from tandem.gateway.errors import bad_request
from tandem.gateway.schemas import ChatCompletionRequest, ChatMessage

# Fields of OpenAI's message schemas besides role and content, by role.
_ROLE_FIELDS = {
    "system": {"name"},
    "developer": {"name"},
    "user": {"name"},
    "assistant": {"name", "refusal", "audio", "tool_calls", "function_call", "annotations"},
    "tool": {"tool_call_id"},
}
# The schema's order, so the first bad field is the one named.
_MESSAGE_FIELDS = tuple(f for f in ChatMessage.model_fields if f not in ("role", "content"))
# Assistant fields served only empty (a past answer had none of these), and why.
_UNSERVED = {
    "tool_calls": "tool calls are not supported by this server",
    "function_call": "function calls are not supported by this server",
    "audio": "audio is not supported by this server",
    "refusal": "refusals are not supported by this server: send the text as content",
}


def engine_message(index: int, message: ChatMessage) -> dict[str, str]:
    if message.role == "tool":
        # A tool message answers an assistant's tool_calls, which are refused:
        # it can only be an orphan, which OpenAI refuses too.
        param = f"messages[{index}].role"
        raise bad_request(
            f"{param}: a 'tool' message answers an assistant's tool_calls, and tool calls "
            "are not supported by this server",
            param,
            "unsupported",
        )
    for name in _MESSAGE_FIELDS:
        value = getattr(message, name)
        if value is None:  # some clients send every field, null where unused
            continue
        param = f"messages[{index}].{name}"
        if name not in _ROLE_FIELDS[message.role]:
            roles = [role for role, names in _ROLE_FIELDS.items() if name in names]
            listed = roles[0] if len(roles) == 1 else f"{', '.join(roles[:-1])} or {roles[-1]}"
            raise bad_request(f"{param} is only allowed in {listed} messages", param)
        if name in _UNSERVED and value:
            raise bad_request(f"{param}: {_UNSERVED[name]}", param, "unsupported")
    # OpenAI's "developer" messages replace "system" ones; chat templates know only
    # the latter (SmolLM2's would keep its default system prompt and add a stray turn).
    role = "system" if message.role == "developer" else message.role
    content = message.content
    param = f"messages[{index}].content"
    if content is None:
        # An assistant's may be null beside tool_calls or a function_call (OpenAI's
        # rule), which are refused above unless empty: with neither it is missing too.
        raise bad_request(f"{param} is missing", param)
    named = {} if message.name is None else {"name": _valid_name(message.name, index)}
    if isinstance(content, str):
        return {"role": role, "content": valid_text(content, param), **named}
    if not content:
        raise bad_request(f"{param} must not be an empty list of parts", param)
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"only text content parts are supported, got type {part.type!r}",
                f"{param}[{j}]",
                "unsupported",
            )
        if part.text is None:
            raise bad_request(
                f"Missing required parameter: {param}[{j}].text", f"{param}[{j}].text"
            )
        # Parts of other types have fields of their own; a text part has only those declared.
        if part.model_extra:
            extra = f"{param}[{j}].{next(iter(part.model_extra))}"
            raise bad_request(f"Unrecognized request argument supplied: {extra}", extra)
        texts.append(valid_text(part.text, f"{param}[{j}].text"))
    # Parts are joined by newlines, as most chat servers do.
    return {"role": role, "content": "\n".join(texts), **named}


# OpenAI's pattern for a participant's name: no spaces, and none of the characters of
# control tokens' text ("<|im_start|>"), which a template renders as they are.
_NAME = re.compile(r"[^\s<|\\/>]+")


def _valid_name(name: str, index: int) -> str:
    """A message's `name`, passed to the chat template (which may render it, as vLLM
    does), else a 400 naming it."""
    param = f"messages[{index}].name"
    if not _NAME.fullmatch(name):
        raise bad_request(
            f"{param} must match the pattern '^[^\\s<|\\\\/>]+$' (no spaces, <, |, \\, / or >), "
            f"got {name!r}",
            param,
        )
    return valid_text(name, param)


def valid_text(value: str, param: str) -> str:
    """Text a tokenizer can take: JSON's \\ud800 escapes can make a lone surrogate."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"{param} is not valid Unicode: a lone surrogate "
            f"(U+{ord(value[exc.start]):04X}) at character {exc.start}",
            param,
        ) from None
    return value


def tools_for_template(body: ChatCompletionRequest) -> bool:
    """Whether the request's tools are served as vLLM serves them with tool_choice
    "none": the template writes them into the prompt, and the answer is a message (no
    tool call is parsed). Other tool use is refused (jobs.py)."""
    return bool(body.tools) and body.tool_choice == "none"


def chat_options(body: ChatCompletionRequest) -> dict[str, Any]:
    """The template options a chat request sets (vLLM's extensions), as the WorkItem
    fields that carry them; the defaults are left out. As in vLLM, chat_template_kwargs
    may set add_generation_prompt and continue_final_message too, and wins."""
    kwargs = dict(body.chat_template_kwargs or {})
    if tools_for_template(body):
        kwargs.setdefault("tools", body.tools)  # the kwargs' own tools win, as in vLLM
    if "chat_template" in kwargs:
        # The engines would render it in place of the model's: a client's Jinja, whose
        # loops hold every request of the engine (LLM.chat's chat_template is the API's).
        raise bad_request(
            "chat_template_kwargs cannot set chat_template: the model's own template renders",
            "chat_template_kwargs",
        )
    if "messages" in kwargs:
        raise bad_request(
            "chat_template_kwargs cannot set messages: give them as messages",
            "chat_template_kwargs",
        )
    flags = {
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
    }
    for name in flags:
        if name in kwargs:
            if not isinstance(kwargs[name], bool):
                raise bad_request(
                    f"chat_template_kwargs' {name} must be true or false, got {kwargs[name]!r}",
                    "chat_template_kwargs",
                )
            flags[name] = kwargs.pop(name)
    adds, goes_on = flags["add_generation_prompt"], flags["continue_final_message"]
    if goes_on and adds is not False:  # vLLM's rule, whose default is true
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: "
            "set add_generation_prompt to false to go on with the last message",
            "continue_final_message",
        )
    options: dict[str, Any] = {}
    if adds is not None:
        options["add_generation_prompt"] = adds
    if goes_on:
        options["continue_final_message"] = True
    if kwargs:
        if _depth(kwargs) > MAX_KWARGS_DEPTH:
            # Deeper, the work item's encoding recursed past Python's limit: a 500 and
            # a 3,000-line traceback, which the SDKs retried twice.
            raise bad_request(
                f"chat_template_kwargs nests objects or arrays more than {MAX_KWARGS_DEPTH} "
                "levels deep",
                "chat_template_kwargs",
            )
        options["chat_template_kwargs"] = kwargs
    return options


# Template variables are tools, documents, flags: a few levels, never hundreds.
MAX_KWARGS_DEPTH = 64


def _depth(value: Any) -> int:
    """How deeply JSON objects and arrays nest in `value` (0 for a scalar); no recursion."""
    deepest, level = 0, [(value, 0)]
    while level:
        item, depth = level.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            if depth + 1 <= MAX_KWARGS_DEPTH:  # past it, the answer is known
                level.extend(
                    (x, depth + 1) for x in (item.values() if isinstance(item, dict) else item)
                )
    return deepest
