"""pydantic's validation errors in the words of OpenAI's API: one 400 naming the first
bad field (`messages[0].role`), what it expected and what came."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.gateway.errors import GatewayError, bad_request


def validation_error(
    errors: Sequence[Mapping[str, Any]], content_type: str | None = None
) -> GatewayError:
    """FastAPI's list of pydantic errors as one 400, naming the first bad field;
    `content_type`: the request's header (a body not sent as JSON is not read as JSON)."""
    if not errors:
        return bad_request("invalid request")
    first = _most_specific(errors)
    kind, ctx = first.get("type", ""), first.get("ctx", {})
    param = _param(first.get("loc", ()))
    if kind == "json_invalid":
        detail = ctx.get("error", "")
        # json's messages end where their position was ("Expecting value"):
        # FastAPI puts it in the location, after "body".
        loc = first.get("loc", ())
        if detail and len(loc) > 1 and isinstance(loc[1], int):
            detail = f"{detail} (character {loc[1]})"
        return bad_request(f"The request body is not valid JSON: {detail}".rstrip(": "))
    if param is None:
        media = (content_type or "").split(";", 1)[0].strip().lower()
        if not media:
            return bad_request("The request has no Content-Type: send the body as application/json")
        if media != "application/json" and not media.endswith("+json"):
            return bad_request(
                f"The body's Content-Type is {media!r}, not read as JSON: send it as "
                "application/json"
            )
        return bad_request("The body must be a JSON object (Content-Type: application/json)")
    for error in errors:  # the wrong route for the body outweighs any other error
        wrong = _param(error.get("loc", ()))
        if error.get("type") == "extra_forbidden" and wrong in _OTHER_ROUTE:
            return bad_request(_OTHER_ROUTE[wrong], wrong)
    if (expected := _union_expected(errors, first)) is not None:
        return bad_request(f"{param} must be {expected}", param)
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return bad_request(f"Missing required parameter: {param}", param)
    if kind == "too_long" and "max_length" in ctx:  # pydantic's says "after validation"
        return bad_request(
            f"Invalid value for {param}: at most {ctx['max_length']} items are allowed, "
            f"got {ctx.get('actual_length')}",
            param,
        )
    message = str(first.get("msg", "invalid value"))
    return bad_request(f"Invalid value for {param}: {message}", param)


# The other route's prompt field sent to this one: say which route takes it.
_OTHER_ROUTE = {
    "messages": "/v1/completions takes a prompt, not messages: "
    "send messages to /v1/chat/completions",
    "prompt": "/v1/chat/completions takes messages, not a prompt: send a prompt to /v1/completions",
}


def _union_expected(errors: Sequence[Mapping[str, Any]], first: Mapping[str, Any]) -> str | None:
    """What a field of several types takes ("a string or a list of strings") when
    its value is none of them (pydantic names only the first); else None."""
    loc = tuple(first.get("loc", ()))
    if not (loc and _is_union_tag(str(loc[-1])) and str(first.get("type")).endswith("_type")):
        return None
    members = [_type_words(str(e["loc"][-1])) for e in errors if tuple(e["loc"])[:-1] == loc[:-1]]
    if None in members:
        return None
    words = list(dict.fromkeys(m[0] for m in members if m is not None))
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


_WORDS = {
    "str": ("a string", "strings"),
    "int": ("an integer", "integers"),
    "float": ("a number", "numbers"),
    "bool": ("a boolean", "booleans"),
    "dict": ("an object", "objects"),
    "ContentPart": ("a content part", "content parts"),
}


def _type_words(tag: str) -> tuple[str, str] | None:
    """A union member's tag ("list[constrained-str]") in words, singular and plural."""
    tag = tag.removeprefix("constrained-")
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _type_words(tag[5:-1])
        return None if inner is None else (f"a list of {inner[1]}", f"lists of {inner[1]}")
    return _WORDS.get(tag.split("[")[0])


def _most_specific(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """Of the errors about the first bad field, the deepest: a value that fits no
    member of a union gets an error per member, and the one that went furthest
    (list[int] at index 1, not "not a string") says best what is wrong. At the
    same depth, a member whose type matched (a list of 5 stop strings: "at most
    4 items") went further than one whose type did not ("not a string")."""
    field = _param(errors[0].get("loc", ())) or ""
    top = field.split(".")[0].split("[")[0]
    same = [e for e in errors if (_param(e.get("loc", ())) or "").startswith(top)]
    return max(
        same or errors[:1],
        key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")),
    )


def _param(loc: Sequence[Any]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; None for the body itself."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "header", "query") else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


# Tags pydantic puts in a location inside a union: "str", "list[int]",
# "function-after[..]", "constrained-str" (a str with a length bound).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_tag(part: str) -> bool:
    return part in _TYPE_TAGS or "[" in part or part.startswith("constrained-")
