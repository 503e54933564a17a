"""Every error the gateway answers, as the OpenAI error body.

`{"error": {"message", "type", "param", "code"}}` is what the OpenAI SDKs parse
into their exception classes, so this module is the one place that builds it:
the gateway's own refusals (GatewayError, one constructor each) and engine
error events. error_handlers.py turns every exception into one of them,
validation_errors.py words pydantic's errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem.context_window import naming_field
from tandem.gateway.schemas import ErrorResponse
from tandem.protocol import ErrorCode

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


def forbidden(message: str, code: str = "model_not_allowed", param: str = "model") -> GatewayError:
    return GatewayError(
        403, message, type="permission_error", param=param, code=code, reason="forbidden"
    )


# A 404 names at most this many of the models served.
_MODELS_NAMED = 8


def model_not_found(
    model: str, served: Sequence[str] = (), *, limited: bool = False
) -> GatewayError:
    """`served`: the models served that the caller may use (a misspelt name is the
    usual cause, and the right one is then in the message); `limited`: the caller's key
    may use only some models (none served read as if the platform served nothing)."""
    shown = ", ".join(sorted(served)[:_MODELS_NAMED])
    if len(served) > _MODELS_NAMED:
        shown += f" and {len(served) - _MODELS_NAMED} more"
    nothing = "none of the models this key may use" if limited else "no model"
    listed = f"; served: {shown} (GET /v1/models)" if served else f"; {nothing} is served now"
    return GatewayError(
        404,
        f"The model {model!r} does not exist or no engine is serving it right now{listed}",
        param="model",
        code="model_not_found",
        reason="unknown_model",
    )


def too_large(limit: int) -> GatewayError:
    return GatewayError(
        413, f"Request body larger than {limit} bytes", code="request_too_large", reason="too_large"
    )


def unsupported_encoding(encoding: str) -> GatewayError:
    return GatewayError(
        415,
        f"Content-Encoding {encoding} is not supported: send the body uncompressed",
        code="unsupported_media_type",
        reason="invalid",
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
    message: str,
    code: str,
    retry_after: float | None,
    *,
    retryable: bool = True,
    type: str = "rate_limit_error",
    reason: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> GatewayError:
    """A 429; `reason` labels the rejection metric where it is not the code; `headers`
    its others (the key's x-ratelimit-*)."""
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(-(-retry_after // 1))))
        # Read first by the OpenAI SDKs: a key of 600 rpm waits 0.1 s, not a whole second.
        headers["retry-after-ms"] = str(max(1, int(-(-retry_after * 1000 // 1))))
    if not retryable:
        headers.update(NO_RETRY)
    return GatewayError(429, message, type=type, code=code, headers=headers, reason=reason or code)


def deadline_exceeded(message: str) -> GatewayError:
    # The SDKs retry a 504: the same request under the same deadline mostly fails alike.
    return GatewayError(
        504, message, type="timeout_error", code="deadline_exceeded", headers=dict(NO_RETRY)
    )


# The code of every answer that failed on Redis (the one docs/gateway.md names).
REDIS_UNREACHABLE = "redis_unreachable"
# A Redis that refuses writes (full, a failed save) is fixed by someone: not soon.
REFUSED_RETRY_AFTER_S = 5
# An unreachable Redis is mostly one restarting (a pod rescheduled): seconds. Without
# the header the SDKs retry after 0.5-1 s, and their retries (2 by default) run out
# before a restarted Redis is back.
UNREACHABLE_RETRY_AFTER_S = 2


def unavailable(
    message: str, code: str = REDIS_UNREACHABLE, retry_after: int = UNREACHABLE_RETRY_AFTER_S
) -> GatewayError:
    return GatewayError(
        503, message, type=SERVER, code=code, headers={"Retry-After": str(retry_after)}
    )


def overloaded(answering: int) -> GatewayError:
    """A completion request past what this replica answers at once (load_shedding.py)."""
    return GatewayError(
        503,
        f"this gateway replica is answering {answering} requests, as many as it takes at "
        "once; retry: another replica, or this one in a moment, answers",
        type=SERVER,
        code="overloaded",
        headers={"Retry-After": "1"},
        reason="overloaded",
    )


def shutting_down() -> GatewayError:
    """A request this replica was still working on when its --shutdown-timeout ran out."""
    return GatewayError(
        503,
        "this gateway replica shut down before the answer was ready (its shutdown "
        "timeout ran out); retry: another replica answers",
        type=SERVER,
        code="shutting_down",
        headers={"Retry-After": "1"},
    )


class RedisOutage(RedisTimeoutError):
    """Redis silent past the gateway's patience, in the gateway's own words."""


def redis_trouble(exc: BaseException) -> str:
    """What went wrong with Redis, for a client: its kind, not redis-py's words, which
    name the cluster's internal host and port (the gateway's log has them)."""
    if isinstance(exc, RedisOutage):
        return str(exc)
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "it did not answer in time"
    if isinstance(exc, AuthenticationError):  # a ConnectionError: said before those
        return "Redis refused the gateway's credentials (--redis-url)"
    if isinstance(exc, OSError | RedisConnectionError):
        return "the connection failed"
    return type(exc).__name__


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


# Engine errors a retry repeats: engines kept failing on the request, and each SDK retry
# queued it afresh to crash as many again. (An engine's deadline is the gateway's own
# 504, deadline_exceeded.)
_NOT_RETRIED = frozenset({ErrorCode.REDELIVERY_LIMIT})


# What an engine refuses of a request it never starts (the prompt, as it sees it; a
# sampling parameter only it can check): answered 400, and its quota given back.
PROMPT_REFUSALS = frozenset(
    {ErrorCode.PROMPT_TOO_LONG, ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.INVALID_REQUEST}
)


def from_engine(
    code: str | None,
    message: str | None,
    prompt_param: str,
    param: str | None = None,
    max_tokens_param: str = "max_tokens",
) -> GatewayError:
    """The answer to an engine's error event, with the engine's own message.

    prompt_param names the field the prompt came in ("messages", "prompt"), and
    max_tokens_param the one max_tokens came in (chat's max_completion_tokens);
    param, the parameter the engine named (ResponseEvent.error_param), if any.
    """
    status, kind = _ENGINE_ANSWERS.get(code or "", (500, SERVER))
    if code == ErrorCode.CONTEXT_LENGTH_EXCEEDED and message is not None:
        message = naming_field(message, max_tokens_param)
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
        code=answered_code(code or ErrorCode.ENGINE_ERROR),
        headers=dict(NO_RETRY) if code in _NOT_RETRIED else None,
    )


def answered_code(code: str) -> str:
    """The code a client gets for an engine's: OpenAI's context_length_exceeded for a
    prompt too long on its own too (clients catch an overflow by that code, to cut the
    prompt and retry), the engine's own otherwise."""
    return ErrorCode.CONTEXT_LENGTH_EXCEEDED if code == ErrorCode.PROMPT_TOO_LONG else code


# ------------------------------------------------------------------ OpenAPI

_DESCRIPTIONS = {
    400: "Invalid request (malformed JSON, wrong types, unsupported parameter, prompt too long)",
    401: "Missing or unknown API key",
    403: "The API key may not use this model",
    404: "Unknown model (no live engine serves it)",
    408: "The body did not arrive in time",
    409: "Idempotency-Key reused with a different request",
    413: "Request body too large",
    415: "A compressed body (Content-Encoding other than identity)",
    429: "Queue full or quota exceeded; see Retry-After",
    500: "Engine or gateway failure",
    503: "Redis unreachable or refusing writes, engines kept failing on the request, the "
    "work cancelled by someone else, engines older than a salted request, a model's "
    "engines lacking a role (prompt or decode) to finish it, or this replica shutting down",
    504: "The request's deadline passed",
}

# `responses=` of every route: each documented error has the OpenAI error body.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _DESCRIPTIONS.items()
}
