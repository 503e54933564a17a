"""Server-sent events: the `data: {...}` framing and a response that notices disconnects.

Starlette's StreamingResponse watches for the client's disconnect only on
older ASGI servers and never closes the body generator itself; this one
always watches, tells the gateway when the client left mid-stream (so it
cancels the work and the engine frees the KV), and always closes the
generator, whatever ended the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.gateway.disconnect import GONE_MIDWAY, wait_for_disconnect
from tandem.gateway.errors import shutting_down

DONE = b"data: [DONE]\n\n"
# An SSE comment: holds an idle stream open through proxies; clients skip it.
KEEPALIVE = b": keep-alive\n\n"
# Where a stream that an error event ended leaves the status that error would have had
# (scope["state"]): its response started 200, and counted so, a decoder failing every
# stream after its first token (the prompt engine's) raised no alert.
STREAM_FAILED = "stream_failed_status"
# Past its deadline (or its start, if that came later), how long a stream may still
# take to go out: the answer's own deadline path may wait on Redis a second to cancel
# and a second to say why before its error goes out, and a client reads it.
_DEADLINE_GRACE_S = 3.0
log = logging.getLogger("tandem.gateway")


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def with_keepalive(
    chunks: AsyncGenerator[bytes, None], every_s: float
) -> AsyncGenerator[bytes, None]:
    """The chunks, and an SSE comment after every `every_s` seconds without one: a
    started stream waiting on its engine (a long prompt's next chunk, a decoder
    restarted mid-answer) sent nothing for as long, and proxies and load balancers
    with an idle timeout (often 60 s) cut it. Clients skip comment lines (the SSE
    format; the OpenAI SDKs do).

    One task reads the chunks into a one-place queue (the client's pace holds it back
    as before), another puts a comment there after a silence: no timer per chunk (a
    timed wait for each cost ~12 us a token). A read is never cancelled for a silence:
    cancelled, a read of the answer's stream would end the generator."""
    queue: asyncio.Queue[bytes | _Ended] = asyncio.Queue(maxsize=1)
    said_at = time.monotonic()

    async def read() -> None:
        try:
            async for chunk in chunks:
                await queue.put(chunk)
            await queue.put(_Ended(None))
        except Exception as error:  # raised where the chunks are taken
            await queue.put(_Ended(error))

    async def keep_alive() -> None:
        while True:
            await asyncio.sleep(max(0.0, said_at + every_s - time.monotonic()))
            if time.monotonic() - said_at >= every_s and queue.empty():
                queue.put_nowait(KEEPALIVE)

    tasks = [asyncio.ensure_future(read()), asyncio.ensure_future(keep_alive())]
    try:
        while not isinstance(item := await queue.get(), _Ended):
            yield item
            said_at = time.monotonic()
        if item.error is not None:
            raise item.error
    finally:  # ended, or stopped mid-wait (the client left, the server stops)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await chunks.aclose()


@dataclass(frozen=True)
class _Ended:
    """The chunks' end: none left, or the error that ended them."""

    error: Exception | None


class EventStreamResponse(StreamingResponse):
    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        on_disconnect: Callable[[], Awaitable[None]],
        deadline: float,
        on_deadline: Callable[[], Awaitable[None]],
        on_server_stop: Callable[[], None],
        failed: Callable[[], int | None] = lambda: None,
    ) -> None:
        super().__init__(
            chunks,
            media_type="text/event-stream",
            # No caching, and no buffering in nginx-like proxies: tokens go out as made.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._chunks = chunks
        self._on_disconnect = on_disconnect
        self._deadline = deadline  # time.monotonic()'s
        self._on_deadline = on_deadline
        self._on_server_stop = on_server_stop
        self._failed = failed  # the status of the error that ended the stream, if one did

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            left = max(self._deadline - time.monotonic(), 0.0) + _DEADLINE_GRACE_S
            try:
                done, _ = await asyncio.wait(
                    {streamer, watch}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
            except asyncio.CancelledError:  # the server's shutdown timeout ran out
                self._on_server_stop()
                await self._end_with_shutdown(scope, send, streamer)
                return
            if not done:
                # A client that stopped reading: the stream waits on a full socket,
                # where the answer's own deadline is never reached. Cut it, and free
                # the engine's KV, as the deadline would have.
                # The server then closes the connection once its buffer drains, or the
                # client leaves: the work and its KV are freed now, either way.
                log.warning(
                    "a stream's client stopped reading; cut at its deadline "
                    "(the server's 'returned without completing response' is this)"
                )
                scope.setdefault("state", {})[STREAM_FAILED] = 504  # counted: not a 200
                await self._on_deadline()
                return
            # Gone: the server said so, or the socket broke while sending.
            gone = not streamer.done() or isinstance(streamer.exception(), OSError)
            if gone:
                scope.setdefault("state", {})[GONE_MIDWAY] = True
                # Before the streamer is stopped: see disconnect.until_disconnected.
                await self._on_disconnect()
            elif (error := streamer.exception()) is not None:
                raise error
            elif (status := self._failed()) is not None:
                scope.setdefault("state", {})[STREAM_FAILED] = status
        finally:
            watch.cancel()
            streamer.cancel()
            await asyncio.gather(streamer, watch, return_exceptions=True)
            await self._chunks.aclose()

    async def _end_with_shutdown(
        self, scope: Scope, send: Send, streamer: asyncio.Future[None]
    ) -> None:
        """End the stream with an error event its client can read: cut bare, an SDK said
        "Connection error.", as for a gateway that crashed."""
        streamer.cancel()
        await asyncio.gather(streamer, return_exceptions=True)
        error = shutting_down()
        scope.setdefault("state", {})[STREAM_FAILED] = error.status
        log.warning("a stream still open at the shutdown timeout was cut: ended with an error")
        with contextlib.suppress(OSError):  # its client left meanwhile
            last = {"type": "http.response.body", "body": sse(error.body()), "more_body": False}
            await send(last)
