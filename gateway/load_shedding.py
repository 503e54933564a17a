"""A replica's bound on the completion requests it answers at once, past which it sheds
load with a 503 before reading the body (nothing is queued).

A request waiting for its events reads them with one of the replica's Redis connections
(`redis_max_connections`, 1,024) for up to a second at a time, and waits at most 5 s for
one: some ten times the pool's requests, and they failed mid-way ("Lost the connection
to Redis"), their work queued for nobody, every request of the replica alike (48 waiting
on a pool of 4: 4 failed). By default a replica sheds past twice its pool: a client
retries (the SDKs retry a 503) and finds a replica with room.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.gateway.errors import overloaded

# The routes whose requests wait on Redis for their answers.
_ANSWERED = ("/v1/chat/completions", "/v1/completions")


class LoadShedder:
    """Pure ASGI: counts the completion requests being answered (to their last byte, a
    stream's too) and answers 503 `overloaded` to one more past `limit`."""

    def __init__(self, app: ASGIApp, limit: int, on_reject: Callable[[str], None]) -> None:
        self.app = app
        self.limit = limit
        self.on_reject = on_reject
        self.answering = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _ANSWERED:
            await self.app(scope, receive, send)
            return
        if self.answering >= self.limit:
            error = overloaded(self.answering)
            self.on_reject(error.reason or "overloaded")
            response = error.response()
            response.headers["Connection"] = "close"  # its body is not read
            await response(scope, receive, send)
            return
        self.answering += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.answering -= 1
