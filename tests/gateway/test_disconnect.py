"""A client that leaves: the engines' work is cancelled before the gateway's is stopped.

The work here stands for a Redis read whose task cancellation is lost (as
redis-py 8.1's asyncio XREAD does at times): it ends only when released, which
the disconnect callback does, as cancelling at the engines ends the stream. Were
the callback run after the work unwound, the call would not end in time.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.gateway.disconnect import ClientGone, until_disconnected
from tandem.gateway.streaming import EventStreamResponse

TIMEOUT_S = 5.0


class StubbornWork:
    """Ignores task cancellation; ends when release() is called."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.log: list[str] = []

    async def run(self) -> str:
        while not self.released.is_set():
            try:
                await self.released.wait()
            except asyncio.CancelledError:
                self.log.append("cancellation lost")
        self.log.append("ended")
        return "answer"

    async def release(self) -> None:
        self.log.append("released")
        self.released.set()


async def ends_in_time(call, work: StubbornWork) -> asyncio.Task:
    """The call's task, done; fails if it needed work.release() from here to end."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({task}, timeout=TIMEOUT_S)
    if not done:
        await work.release()  # unstick it, so the failure does not hang the run
        await asyncio.wait({task})
    assert done, "the call waited for work that only cancelling at the engines ends"
    return task


def receive_disconnect_when(event: asyncio.Event):
    async def receive() -> dict:
        await event.wait()
        return {"type": "http.disconnect"}

    return receive


def test_a_disconnect_cancels_the_work_before_waiting_for_it() -> None:
    async def main() -> list[str]:
        work, gone = StubbornWork(), asyncio.Event()
        gone.set()
        call = until_disconnected(receive_disconnect_when(gone), work.run(), work.release)
        task = await ends_in_time(call, work)
        with pytest.raises(ClientGone):
            task.result()
        return work.log

    log = asyncio.run(main())
    assert log[0] == "released" and log[-1] == "ended"


def test_work_that_finishes_first_is_answered_and_nothing_is_cancelled() -> None:
    async def main() -> tuple[str, list[str]]:
        work, never = StubbornWork(), asyncio.Event()
        work.released.set()  # it ends at once
        calls: list[str] = []

        async def on_gone() -> None:
            calls.append("on_gone")

        result = await until_disconnected(receive_disconnect_when(never), work.run(), on_gone)
        return result, calls

    assert asyncio.run(main()) == ("answer", [])


def test_a_stream_whose_client_left_calls_on_disconnect_before_it_unwinds() -> None:
    async def main() -> tuple[list[str], list[dict]]:
        work, gone = StubbornWork(), asyncio.Event()
        sent: list[dict] = []

        async def chunks():
            yield b"data: first\n\n"
            gone.set()  # the client leaves after the first chunk
            await work.run()
            yield b"data: never sent\n\n"

        async def send(message: dict) -> None:
            if not gone.is_set():  # as the server: nothing goes out once the client left
                sent.append(message)

        deadline = time.monotonic() + 60
        response = EventStreamResponse(chunks(), work.release, deadline, _never, _nothing)
        call = response({"type": "http"}, receive_disconnect_when(gone), send)
        (await ends_in_time(call, work)).result()
        return work.log, sent

    log, sent = asyncio.run(main())
    assert log[0] == "released"
    bodies = [m.get("body") for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: first\n\n"]


async def _never() -> None:
    raise AssertionError("called")


def test_a_stream_whose_client_stopped_reading_is_cut_at_its_deadline() -> None:
    # The answer's deadline is checked between reads from Redis: a stream waiting on
    # a full socket never got there, and the engine generated on for nobody.
    async def main() -> tuple[list[str], float]:
        cut: list[str] = []
        stuck = asyncio.Event()  # never set: the client's socket stays full

        async def chunks():
            while True:
                yield b"data: token\n\n"

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                await stuck.wait()

        async def on_deadline() -> None:
            cut.append("deadline")

        started = time.monotonic()
        response = EventStreamResponse(chunks(), _never, started + 0.2, on_deadline, _nothing)
        await asyncio.wait_for(response({"type": "http"}, asyncio.Event().wait, send), TIMEOUT_S)
        return cut, time.monotonic() - started

    cut, took = asyncio.run(main())
    assert cut == ["deadline"]
    assert 3.2 < took < 4.5  # the deadline and its grace (3 s)


def _nothing() -> None:
    """The server does not stop in these tests: nothing to do when it would."""
