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
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")

# What a request whose client left is counted and logged as (nginx's "client
# closed request"), a stream dropped after its 200 went out included.
CLIENT_GONE = 499
# Set in the request's scope["state"] when the client left after the response
# started: the metrics count it as CLIENT_GONE, not as the status it was sent.
GONE_MIDWAY = "client_gone_midway"


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(
    receive: Receive, awaitable: Awaitable[T], on_gone: Callable[[], Awaitable[None]]
) -> T:
    """The awaitable's result; or, if the client disconnects first, on_gone()
    awaited, the awaitable cancelled, and ClientGone raised.

    on_gone (which cancels the engines' work) runs before the awaitable is
    stopped, not after: a task's cancellation can be lost inside the Redis
    client (redis-py 8.1's asyncio XREAD was seen returning normally after its
    task was cancelled, the reading loop going on), and the awaitable then runs
    until the work ends, which only on_gone brings about early.
    """
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
    await on_gone()
    work.cancel()
    # Let it unwind (its generators close, its Redis read is abandoned) first.
    await asyncio.gather(work, return_exceptions=True)
    raise ClientGone()
