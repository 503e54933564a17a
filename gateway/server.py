"""The HTTP server around the app: uvicorn, with a deadline for each request's headers.

uvicorn times a connection out only between requests (its keep-alive, armed after a
response): a connection that opened and sent nothing, or its headers a byte now and
then, was held for ever. About 20,000 of them, the process's file descriptors, took
the gateway down for everyone, no API key needed, and asyncio logged each refused
accept (hundreds of megabytes a minute). Now a connection that has not sent a whole
request's headers within `header_timeout_s` of waiting for them is closed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.gateway.settings import GatewaySettings


class HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol; a connection waiting for a request's headers (or the rest
    of a body its answer left unread) longer than `headers_within_s`, from its opening
    or its last response, is closed."""

    def __init__(self, *args: Any, headers_within_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._headers_within_s = headers_within_s
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        """Whether the connection waits for the client's next request: its headers (IDLE:
        h11 leaves it once they are all in), or the rest of a body left unread by the
        answer (a GET with one, a 404, a 405), which must end before the next request can
        begin: a byte of it now and then held the connection for ever."""
        if self.transport.is_closing():
            return False
        their = self.conn.their_state
        return their is h11.IDLE or (their is h11.SEND_BODY and self.conn.our_state is h11.DONE)

    def _watch_headers(self) -> None:
        waiting = self._waiting()
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self._headers_within_s, self._too_slow)
        elif not waiting:
            self._stop_timer()

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self._waiting():
            self.transport.close()


def server_config(app: Any, settings: GatewaySettings, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` on the settings' host and port; `options` are
    uvicorn's own (log_level, access_log, timeouts)."""
    protocol = functools.partial(HeaderDeadlineH11, headers_within_s=settings.header_timeout_s)
    return uvicorn.Config(app, host=settings.host, port=settings.port, http=protocol, **options)


class OncePer(logging.Filter):
    """Lets messages that start with one of `messages` through once per `seconds`
    each: asyncio logs a refused accept() once per waiting connection, thousands a
    second at the descriptor limit."""

    def __init__(self, messages: tuple[str, ...], seconds: float) -> None:
        super().__init__()
        self._messages, self._seconds = messages, seconds
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        start = next((m for m in self._messages if text.startswith(m)), None)
        if start is None:
            return True
        now = time.monotonic()
        if now - self._last.get(start, -self._seconds) < self._seconds:
            return False
        self._last[start] = now
        return True


class ShutdownCuts(logging.Filter):
    """uvicorn's "Exception in ASGI application" for a request its graceful-shutdown
    timeout cancelled, as one warning line: it is no error of the app's, and a
    traceback per request still open paged whoever alerts on ERROR lines."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Cancel ") and "graceful shutdown" in str(record.msg):
            # "Cancel N running task(s), timeout graceful shutdown exceeded": each is
            # said below (or answered 503), and ERROR paged on every such stop.
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError) and str(record.msg).startswith(
            "Exception in ASGI application"
        ):
            record.msg = "a request still open at the shutdown timeout (%gs) was cut"
            record.args = (self._timeout_s,)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


def graceful_seconds(shutdown_timeout: float) -> int:
    """uvicorn's whole seconds of graceful shutdown for --shutdown-timeout: never fewer
    than asked (int() cut 2.9 s to 2), and at least one."""
    return max(1, math.ceil(shutdown_timeout))


def quiet_server_logs(shutdown_timeout_s: float) -> None:
    """asyncio's "socket.accept() out of system resource" at most once every 10 s, and
    requests cut by the shutdown timeout as one line each (ShutdownCuts)."""
    logging.getLogger("asyncio").addFilter(OncePer(("socket.accept() out of system",), 10.0))
    logging.getLogger("uvicorn.error").addFilter(ShutdownCuts(shutdown_timeout_s))
