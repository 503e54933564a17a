"""Every error the gateway answers, as the OpenAI error body.

`{"error": {"message", "type", "param", "code"}}` is what the OpenAI SDKs parse
into their exception classes, so this module is the one place that builds it:
from the gateway's own refusals (GatewayError), from FastAPI's validation
errors (answered 400, not FastAPI's 422: OpenAI clients expect 400), from
unknown routes, from engine error events, and from anything unexpected.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.gateway.schemas import ErrorResponse
from tandem.protocol import ErrorCode
from tandem.redis_refusal import plain, refusal

log = logging.getLogger("tandem.gateway")

INVALID = "invalid_request_error"
SERVER = "server_error"


class GatewayError(Exception):
    """A request the gateway answers with an error instead of a completion.

    `reason` labels the rejection metric (None: not a rejection, e.g. an
    engine failure after the request was admitted).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.reason = reason

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def error_body(
    message: str, type: str = INVALID, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------- constructors


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code, reason="invalid")


def not_supported(param: str, what: str | None = None) -> GatewayError:
    return bad_request(f"{what or param} is not supported by this server", param, "unsupported")


def unauthorized(message: str, code: str) -> GatewayError:
    return GatewayError(401, message, type="authentication_error", code=code, reason="auth")


def forbidden(message: str) -> GatewayError:
    return GatewayError(
        403,
        message,
        type="permission_error",
        param="model",
        code="model_not_allowed",
        reason="forbidden",
    )


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model {model!r} does not exist or no engine is serving it right now",
        param="model",
        code="model_not_found",
        reason="unknown_model",
    )


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        413, f"Request body larger than {limit} bytes", code="request_too_large", reason="too_large"
    )


def body_too_slow(seconds: float) -> GatewayError:
    return GatewayError(
        408,
        f"The request body did not arrive within {seconds:g} s",
        code="request_timeout",
        reason="body_timeout",
    )


# The OpenAI SDKs retry every 408, 409, 429 and 5xx unless the answer says not to.
NO_RETRY = {"x-should-retry": "false"}


def rate_limited(
    message: str, code: str, retry_after: float | None, *, retryable: bool = True
) -> GatewayError:
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))
    if not retryable:
        headers.update(NO_RETRY)
    return GatewayError(
        429, message, type="rate_limit_error", code=code, headers=headers, reason=code
    )


def deadline_exceeded(message: str) -> GatewayError:
    # The SDKs retry a 504: the same request under the same deadline mostly fails alike.
    headers = {"x-should-retry": "false"}
    return GatewayError(
        504, message, type="timeout_error", code="deadline_exceeded", headers=headers
    )


# The code of every answer that failed on Redis (the one docs/gateway.md names).
REDIS_UNREACHABLE = "redis_unreachable"
# A Redis that refuses writes (full, a failed save) is fixed by someone: not soon.
REFUSED_RETRY_AFTER_S = 5


def unavailable(message: str, code: str = REDIS_UNREACHABLE) -> GatewayError:
    return GatewayError(503, message, type=SERVER, code=code)


def missing_role(model: str, missing: str, present: str, retry_after: int) -> GatewayError:
    """A model no controller declares, served only by engines of one disaggregated role:
    nothing will bring the other role, so a queued request could only time out."""
    verb = "finish" if missing == "completion" else "start"
    return GatewayError(
        503,
        f"No {_ROLE_WORDS[missing]} engine is serving {model!r}; its {_ROLE_WORDS[present]} "
        f"engines cannot {verb} a request alone. Start a {missing} engine "
        f"(tandem engine --role {missing}) or retry later",
        type=SERVER,
        param="model",
        code="missing_engine_role",
        headers={"Retry-After": str(retry_after)},
        reason="missing_role",
    )


_ROLE_WORDS = {"prompt": "prompt", "completion": "decode (completion)", "normal": "normal"}


# Engine error codes (docs/protocol.md) and the answer each gets.
_ENGINE_ANSWERS: dict[str, tuple[int, str]] = {
    ErrorCode.PROMPT_TOO_LONG: (400, INVALID),
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: (400, INVALID),
    ErrorCode.INVALID_REQUEST: (400, INVALID),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    ErrorCode.REDELIVERY_LIMIT: (503, SERVER),
    ErrorCode.ENGINE_ERROR: (500, SERVER),
    # Someone else cancelled it (another replica whose client left with the
    # same Idempotency-Key, an operator): nothing will come.
    ErrorCode.CANCELLED: (503, SERVER),
}


# What an engine refuses of a request it never starts (the prompt, as it sees it; a
# sampling parameter only it can check): answered 400, and its quota given back.
PROMPT_REFUSALS = frozenset(
    {ErrorCode.PROMPT_TOO_LONG, ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.INVALID_REQUEST}
)


def from_engine(
    code: str | None, message: str | None, prompt_param: str, param: str | None = None
) -> GatewayError:
    """The answer to an engine's error event, with the engine's own message.

    prompt_param names the field the prompt came in ("messages", "prompt");
    param, the parameter the engine named (ResponseEvent.error_param), if any.
    """
    status, kind = _ENGINE_ANSWERS.get(code or "", (500, SERVER))
    # The gateway checked the sampling parameters before queueing (with the
    # engine's own SamplingParams); what only the engine can check of them
    # (a logit_bias id past its vocabulary) it names. Anything else it refuses
    # is the prompt: a token id outside the vocabulary, a conversation the chat
    # template refuses, besides its length.
    if param is None and code in PROMPT_REFUSALS:
        param = prompt_param
    return GatewayError(
        status,
        message or f"engine error {code}",
        type=kind,
        param=param,
        code=code or ErrorCode.ENGINE_ERROR,
    )


# ------------------------------------------------------------------ OpenAPI

_DESCRIPTIONS = {
    400: "Invalid request (malformed JSON, wrong types, unsupported parameter, prompt too long)",
    401: "Missing or unknown API key",
    403: "The API key may not use this model",
    404: "Unknown model (no live engine serves it)",
    409: "Idempotency-Key reused with a different request",
    413: "Request body too large",
    429: "Queue full or quota exceeded; see Retry-After",
    500: "Engine or gateway failure",
    503: "Redis unreachable, engines kept failing on the request, or a model's engines "
    "lack a role (prompt or decode) to finish it",
    504: "The request's deadline passed",
}

# `responses=` of every route: each documented error has the OpenAI error body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _DESCRIPTIONS.items()
}


# ----------------------------------------------------------------- handlers


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _on_gateway_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(RedisError, _on_redis_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
    if exc.reason is not None:
        request.app.state.gateway.metrics.rejected(exc.reason)
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await _on_gateway_error(request, validation_error(exc.errors()))


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body": say what was wrong.
        return await _on_gateway_error(request, bad_request(_unparsable(exc.__cause__)))
    kind = INVALID if exc.status_code < 500 else SERVER
    error = GatewayError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)
    return error.response()


def _unparsable(cause: BaseException) -> str:
    """Why a body that is not a JSONDecodeError could not be read as JSON."""
    if isinstance(cause, UnicodeDecodeError):
        return f"The request body is not valid UTF-8: {cause.reason} at byte {cause.start}"
    if isinstance(cause, RecursionError):
        return "The request body is not valid JSON here: it nests arrays or objects too deeply"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        # Python's message advises a setting of the server's, sys.set_int_max_str_digits.
        return (
            "The request body is not valid JSON here: a number in it is too long "
            f"(more than {sys.get_int_max_str_digits()} digits)"
        )
    return f"The request body is not valid JSON: {cause}"


async def _on_redis_error(request: Request, exc: RedisError) -> JSONResponse:
    log.warning("redis error on %s %s: %s", request.method, request.url.path, exc)
    if (why := refusal(exc)) is not None:  # it answers, but takes no work for now
        error = unavailable(f"{why}: {plain(exc)}")
        error.headers["Retry-After"] = str(REFUSED_RETRY_AFTER_S)
        return error.response()
    return unavailable(f"The gateway cannot reach Redis: {exc}").response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Answered outside the middleware that names every answer: named here, and logged
    # under the same id, the one a user quotes to whoever reads this log.
    rid = str(getattr(request.state, "request_id", "") or "unnamed")
    log.exception("unexpected error on %s %s (%s)", request.method, request.url.path, rid)
    error = GatewayError(
        500, f"internal error: {type(exc).__name__}", type=SERVER, headers={"x-request-id": rid}
    )
    return error.response()


def validation_error(errors: Sequence[Mapping[str, Any]]) -> GatewayError:
    """FastAPI's list of pydantic errors as one 400, naming the first bad field."""
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
