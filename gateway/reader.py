"""Reads the response streams of a request's work items, on redis.asyncio.

The asyncio twin of the engine package's `responses.ResponseReader.events`, for
several streams at once (the n choices of one request share one XREAD), each
through its own `tandem.deduplicator.ResponseDeduplicator`: the rule that drops
tokens an engine wrote twice (after a takeover) lives there only.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

import redis.asyncio as aioredis

from tandem.deduplicator import ResponseDeduplicator
from tandem.gateway.settings import MAX_READ_BLOCK_MS
from tandem.protocol import Keys, ResponseEvent, as_text


class DeadlinePassed(TimeoutError):
    """The request's deadline passed before every choice ended."""


class AsyncResponseReader:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, *, block_ms: int = MAX_READ_BLOCK_MS
    ) -> None:
        if not 1 <= block_ms <= MAX_READ_BLOCK_MS:
            raise ValueError(f"block_ms must be in 1..{MAX_READ_BLOCK_MS}, got {block_ms}")
        self.client = client
        self.keys = keys
        self.block_ms = block_ms

    async def events(
        self, request_ids: Sequence[str], deadline: float
    ) -> AsyncIterator[tuple[int, ResponseEvent]]:
        """Yield (choice index, event) as a client should see them, until every
        choice has had its final event.

        `deadline` is in time.monotonic() seconds; DeadlinePassed is raised when it
        passes first. Raises ProtocolError on an event this gateway cannot read.
        Reads block at most block_ms (a blocking read longer than the client's
        socket timeout fails), and never past the deadline.
        """
        if not request_ids:
            return
        index = {self.keys.response_stream(rid): i for i, rid in enumerate(request_ids)}
        last = dict.fromkeys(index, "0-0")
        dedup = [ResponseDeduplicator() for _ in request_ids]
        while last:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise DeadlinePassed(f"deadline passed for {', '.join(request_ids)}")
            reply = await self.client.xread(last, block=min(self.block_ms, left_ms))
            for raw_name, entries in reply or ():
                name = as_text(raw_name)
                i = index[name]
                for entry_id, fields in entries:
                    last[name] = as_text(entry_id)
                    passed = dedup[i].accept(ResponseEvent.from_fields(fields))
                    if passed is not None:
                        yield i, passed
                    if dedup[i].done:
                        del last[name]
                        break
