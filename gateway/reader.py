"""Reads the response streams of a request's work items, on redis.asyncio.

The asyncio twin of the tests' `support.response_reader.ResponseReader.events`, for
several streams at once (the n choices of one request share one XREAD), each
through its own `tandem.deduplicator.ResponseDeduplicator`: the rule that drops
tokens an engine wrote twice (after a takeover) lives there only.

Two things a Redis restart does are handled here, on the reads' own wake-ups:
a read that fails is tried again until Redis is back (`outage_s` at most), and
a `Watch` (recovery.LossWatch) may queue again the work Redis lost, whose
streams are then read from the start (the history written back is dropped by
offset, as the client has it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem.deduplicator import ResponseDeduplicator
from tandem.gateway.errors import RedisOutage
from tandem.gateway.settings import MAX_READ_BLOCK_MS
from tandem.keys import Keys
from tandem.protocol import EventKind, ResponseEvent, as_text

# Between reads that failed for want of Redis.
_OUTAGE_RETRY_S = 0.25
# How long past its block a read may go unanswered before Redis counts as stalled.
_STALLED_READ_S = 2.0
# Entries one read takes of each stream: a client that stops reading holds at most this
# much in the gateway. Without a bound a read took a stream's whole backlog, and each
# attached retry of a finished n=16 answer held a copy (~24 MiB) until its deadline.
READ_BATCH = 256


class DeadlinePassed(TimeoutError):
    """The request's deadline passed before every choice ended."""


class ResponseGap(Exception):
    """A choice's stream skips tokens the gateway never read: Redis lost them (it came
    back empty, or without its last writes) while its engine served on. Passed on,
    the answer had a hole in its text and still reported its whole usage."""

    def __init__(self, choice: int, seen: int, offset: int) -> None:
        super().__init__(f"choice {choice}: tokens {seen} to {offset - 1} never read")
        self.choice, self.seen, self.offset = choice, seen, offset


class Watch(Protocol):
    async def requeued(
        self, open_choices: Callable[[], Mapping[int, ResponseDeduplicator]]
    ) -> list[int]: ...


class AsyncResponseReader:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        *,
        block_ms: int = MAX_READ_BLOCK_MS,
        outage_s: float = 10.0,
        batch: int = READ_BATCH,
    ) -> None:
        if not 1 <= block_ms <= MAX_READ_BLOCK_MS:
            raise ValueError(f"block_ms must be in 1..{MAX_READ_BLOCK_MS}, got {block_ms}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.batch = batch
        self.client = client
        self.keys = keys
        self.block_ms = block_ms
        self.outage_s = outage_s
        # Reads whose request was cancelled (the client went away), left to end.
        self._abandoned: set[asyncio.Task] = set()

    async def events(
        self, request_ids: Sequence[str], deadline: float, watch: Watch | None = None
    ) -> AsyncIterator[tuple[int, ResponseEvent]]:
        """Yield (choice index, event) as a client should see them, until every
        choice has had its final event.

        `deadline` is in time.monotonic() seconds; DeadlinePassed is raised when it
        passes first. Raises ProtocolError on an event this gateway cannot read,
        ResponseGap on one past tokens it never read,
        and Redis's ConnectionError or TimeoutError when Redis stayed out of reach
        for `outage_s`. Reads block at most block_ms (a blocking read longer than
        the client's socket timeout fails), and never past the deadline.
        """
        if not request_ids:
            return
        names = [self.keys.response_stream(rid) for rid in request_ids]
        index = {name: i for i, name in enumerate(names)}
        last = dict.fromkeys(names, "0-0")
        dedup = [ResponseDeduplicator() for _ in request_ids]
        unreachable_since: float | None = None

        def open_choices() -> dict[int, ResponseDeduplicator]:
            # For the watch, which builds it only after a restart, not on every wake-up.
            return {index[name]: dedup[index[name]] for name in last}

        while last:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise DeadlinePassed(f"deadline passed for {', '.join(request_ids)}")
            asked = time.monotonic()
            block_ms = min(self.block_ms, left_ms)
            try:
                # A read Redis leaves unanswered past its block is a stalled Redis: a
                # paused one otherwise held it the whole socket timeout (5 s), past
                # the deadline too. Shielded (_read), it still ends on its own. Never
                # past the deadline: the deadline's error must still go out within the
                # stream's grace (streaming.py), and a read held 2 s past it, then the
                # cancel and the stall's look, each waiting on the paused Redis, did not.
                wait_s = min(block_ms / 1000 + _STALLED_READ_S, left_ms / 1000)
                async with asyncio.timeout(wait_s):
                    reply = await self._read(last, block_ms)
            except (RedisConnectionError, RedisTimeoutError, TimeoutError) as exc:
                # The client's own retries (about 0.3 s) did not outlast a restart, or
                # Redis left the read unanswered: the outage began when it was sent.
                now = time.monotonic()
                unreachable_since = unreachable_since or asked
                if now - unreachable_since >= self.outage_s:
                    if isinstance(exc, RedisError):
                        raise
                    raise RedisOutage(
                        f"no answer from Redis for {now - unreachable_since:.1f} s"
                    ) from None
                await asyncio.sleep(min(_OUTAGE_RETRY_S, max(0.0, deadline - now)))
                continue
            unreachable_since = None
            for raw_name, entries in reply or ():
                name = as_text(raw_name)
                i = index[name]
                for entry_id, fields in entries:
                    last[name] = as_text(entry_id)
                    event = ResponseEvent.from_fields(fields)
                    if event.offset > dedup[i].next_offset and event.event != EventKind.ERROR:
                        raise ResponseGap(i, dedup[i].next_offset, event.offset)
                    passed = dedup[i].accept(event)
                    if passed is not None:
                        yield i, passed
                    if dedup[i].done:
                        del last[name]
                        break
            if watch is not None and last:
                for i in await watch.requeued(open_choices):
                    last[names[i]] = "0-0"

    async def _read(self, last: Mapping[str, str], block_ms: int) -> list:
        """XREAD, left to end on its own if the caller is cancelled.

        A blocking read cancelled midway leaves its connection with a reply on the
        way, so redis-py closes it: every cancelled stream (a client gone) cost a
        new connection, hundreds a second of them under cancels, each left in
        TIME_WAIT. Shielded, the read ends within block_ms (1 s at most) and its
        connection goes back to the pool.
        """
        read = asyncio.ensure_future(self.client.xread(last, count=self.batch, block=block_ms))
        try:
            return await asyncio.shield(read)
        except asyncio.CancelledError:
            self._abandoned.add(read)  # a strong reference: asyncio keeps weak ones
            read.add_done_callback(self._forget)
            raise

    def _forget(self, read: asyncio.Task) -> None:
        self._abandoned.discard(read)
        if not read.cancelled():
            read.exception()  # retrieved: a failed abandoned read is nobody's error
