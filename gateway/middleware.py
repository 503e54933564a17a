"""Two pure-ASGI middlewares: the body size limit, and the per-request metrics and id.

Pure ASGI rather than Starlette's BaseHTTPMiddleware: that one runs the app in
another task and costs a few hundred microseconds a request, and it hides the
client's disconnect from the app, which the gateway needs to cancel work.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.gateway.auth import ApiKey
from tandem.gateway.disconnect import CLIENT_GONE, GONE_MIDWAY, ClientGone
from tandem.gateway.errors import (
    GatewayError,
    body_too_slow,
    shutting_down,
    too_large,
    unsupported_encoding,
)
from tandem.gateway.metrics import UNKNOWN_MODEL, GatewayMetrics, route_label
from tandem.gateway.streaming import STREAM_FAILED

# Where routes leave the model label for the metrics (request.state.model_label).
MODEL_LABEL = "model_label"
# Where the service leaves the id of the work admitted (request.state.request_id): the
# response's id without its prefix, which the engines' logs and traces carry too.
REQUEST_ID = "request_id"
REQUEST_ID_HEADER = b"x-request-id"
# Where the service leaves an admitted request's x-ratelimit-* headers
# (request.state.rate_limits), the key's quotas after it.
RATE_LIMITS = "rate_limits"
# Where BodyLimit leaves the caller it authenticated (request.state.caller): the
# route's dependency takes it from there rather than hashing the key again.
CALLER = "caller"
log = logging.getLogger("tandem.gateway")


class BodyLimit:
    """Answers 401 before reading the body of a request without a valid key (a stranger
    may not hold the server's memory for `timeout_s` with a megabyte each), 413 for a
    body over `max_bytes`, declared or actually sent, and 408 for one not whole
    within `timeout_s`.

    The body is read here in full (it is small: JSON up to max_bytes) and
    replayed to the app; later receive() calls go to the server, so the app
    still hears of the client's disconnect.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_reject: Callable[[str, str | None], None],
        timeout_s: float,
        authenticate: Callable[[list[str]], ApiKey],
    ) -> None:
        self.app = app
        self.authenticate = authenticate  # KeyStore.caller: the caller, or a 401
        self.max_bytes = max_bytes
        # Counts a refusal: its reason, and the caller's key name (None: not known yet).
        self.on_reject = on_reject
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            caller = self.authenticate(_header_values(scope, b"authorization"))
            scope.setdefault("state", {})[CALLER] = caller
        except GatewayError as error:
            await self._refuse(error, send, None)
            return
        name = caller.name
        encodings = [v.strip().lower() for v in _header_values(scope, b"content-encoding")]
        if any(e not in ("", "identity") for e in encodings):
            # Read as it came, a compressed body was "not valid UTF-8", which named nothing.
            await self._refuse(unsupported_encoding(", ".join(encodings)), send, name)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(too_large(self.max_bytes), send, name)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            await self._refuse(body_too_slow(self.timeout_s), send, name)
            return
        except GatewayError as error:
            await self._refuse(error, send, name)
            return
        except ClientGone:
            # Nobody to answer: counted as gone (499), not as the server error an
            # unanswered request reads as.
            scope.setdefault("state", {})[GONE_MIDWAY] = True
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes:
        """The whole body: ClientGone if the client leaves first, 413 past max_bytes."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise too_large(self.max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse(self, error: GatewayError, send: Send, key: str | None) -> None:
        self.on_reject(error.reason or "rejected", key)
        response = error.response()
        # The rest of the body is not read: the connection cannot be reused.
        response.headers["Connection"] = "close"
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _header_values(scope: Scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope.get("headers", ()) if key == name]


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestObserver:
    """Counts every request by route, model and status; times it to its last byte; names
    it in an x-request-id header, as OpenAI's API does (its SDKs show it as
    `_request_id`): the admitted work's id, else one of its own.

    A client that left is counted as 499, also when its stream had started (200).
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, shutdown_s: float = 0.0) -> None:
        self.app = app
        self.metrics = metrics
        self.shutdown_s = shutdown_s  # the server's graceful shutdown, for the log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        started = time.perf_counter()
        state = scope.setdefault("state", {})
        state["arrived"] = started
        # Its own until the service names the work admitted (error_handlers reads
        # it too: Starlette answers an unexpected error outside this middleware).
        state[REQUEST_ID] = f"req_{uuid.uuid4().hex}"
        status = 500  # an exception that escapes every handler
        started_response = False
        finished_at: float | None = None

        async def observed(message: Message) -> None:
            nonlocal status, started_response, finished_at
            if message["type"] == "http.response.start":
                status, started_response = message["status"], True
                rid = str(state[REQUEST_ID])
                limits = [(k.encode(), v.encode()) for k, v in state.get(RATE_LIMITS, {}).items()]
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER, rid.encode()), *limits]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished_at = time.perf_counter()
            await send(message)

        self.metrics.started(route)
        try:
            await self.app(scope, receive, observed)
        except asyncio.CancelledError:
            # The server's graceful-shutdown timeout cancels what is still open: a
            # stream that started is cut (its client sees the connection end), one
            # not answered yet gets this error, where the server's own was a
            # plain-text 500 an SDK shows as "Internal Server Error".
            if started_response:
                raise  # a response started: the server closes the connection
            log.warning(
                "a request still open at the shutdown timeout (%gs) was cut: answered 503",
                self.shutdown_s,
            )
            response = shutting_down().response()
            response.headers["Connection"] = "close"
            await response({"type": "http"}, _no_receive, observed)
        finally:
            seconds = (finished_at or time.perf_counter()) - started
            model = str(state.get(MODEL_LABEL, UNKNOWN_MODEL))
            if state.get(GONE_MIDWAY):
                status = CLIENT_GONE
            elif (failed := state.get(STREAM_FAILED)) is not None:
                status = failed
            self.metrics.finished(route, model, status, seconds)
