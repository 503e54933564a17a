"""The gateway's exception handlers: every error it answers leaves as the OpenAI body.

Its own refusals (GatewayError), FastAPI's validation errors (400, not FastAPI's
422: OpenAI clients expect 400), unknown routes, Redis failures, and anything
unexpected (500, named by the request's x-request-id in the answer and the log).
"""

from __future__ import annotations

import logging
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.gateway.errors import (
    INVALID,
    REFUSED_RETRY_AFTER_S,
    SERVER,
    GatewayError,
    bad_request,
    redis_trouble,
    unavailable,
)
from tandem.gateway.middleware import CALLER
from tandem.gateway.validation_errors import validation_error
from tandem.redis_refusal import plain, refusal

log = logging.getLogger("tandem.gateway")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _on_gateway_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _on_validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)  # type: ignore[arg-type]
    app.add_exception_handler(RedisError, _on_redis_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _on_unexpected)


async def _on_gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
    if exc.reason is not None:
        caller = request.scope.get("state", {}).get(CALLER)  # None: refused before it was known
        request.app.state.gateway.metrics.rejected(exc.reason, caller and caller.name)
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    content_type = request.headers.get("content-type")
    return await _on_gateway_error(request, validation_error(exc.errors(), content_type))


async def _on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body": say what was wrong.
        return await _on_gateway_error(request, bad_request(_unparsable(exc.__cause__)))
    kind = INVALID if exc.status_code < 500 else SERVER
    message = str(exc.detail)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and message == "Not Found":  # no route: say it as OpenAI does
        message = f"Invalid URL ({where}): {_ROUTES}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow")  # as Starlette's router sets it
        message = f"Method {request.method} is not allowed for {request.url.path}" + (
            f"; use {allowed}" if allowed else ""
        )
    error = GatewayError(exc.status_code, message, type=kind, headers=exc.headers)
    return error.response()


_ROUTES = (
    "this server answers POST /v1/chat/completions, POST /v1/completions, GET /v1/models "
    "and GET /v1/models/{model}"
)


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
        return unavailable(f"{why}: {plain(exc)}", retry_after=REFUSED_RETRY_AFTER_S).response()
    return unavailable(f"The gateway cannot reach Redis: {redis_trouble(exc)}").response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Answered outside the middleware that names every answer: named here, and logged
    # under the same id, the one a user quotes to whoever reads this log.
    rid = str(getattr(request.state, "request_id", "") or "unnamed")
    log.exception("unexpected error on %s %s (%s)", request.method, request.url.path, rid)
    error = GatewayError(
        500, f"internal error: {type(exc).__name__}", type=SERVER, headers={"x-request-id": rid}
    )
    return error.response()
