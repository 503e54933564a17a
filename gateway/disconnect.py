"""Noticing that the HTTP client went away, so its work can be cancelled.

After the body is read, the server's receive() only ever answers
`http.disconnect` (the client closed the connection, or the response is
complete), so a task waiting on it learns of a disconnect the moment the
server does, without polling. The gateway cancels work only on that signal
(or a deadline): when the server itself shuts down and cancels the request's
task, the queued work is left for the engines, so a client that retries with
the same Idempotency-Key through another replica still gets its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(receive: Receive, awaitable: Awaitable[T]) -> T:
    """The awaitable's result, or ClientGone (after cancelling it) if the client
    disconnects first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        # Cancelled from outside (server shutdown): stop both, leave the work queued.
        work.cancel()
        watch.cancel()
        raise
    if work.done():
        watch.cancel()
        return work.result()
    work.cancel()
    # Let it unwind (its generators close, its Redis read is abandoned) first.
    await asyncio.gather(work, return_exceptions=True)
    raise ClientGone()
