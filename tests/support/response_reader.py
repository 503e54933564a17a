"""A blocking reader of a request's response stream, for tests and their engines.

The gateway reads with `tandem.gateway.reader.AsyncResponseReader` (asyncio, several
streams at once, a deadline for the whole answer); tests that drive engines without
a gateway read with this one, through the same `ResponseDeduplicator`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import redis

from tandem.deduplicator import ResponseDeduplicator
from tandem.keys import Keys
from tandem.protocol import ResponseEvent, as_text

# Longest single blocking read of a response stream.
MAX_BLOCK_MS = 1000


class ResponseReader:
    """Reads a request's events as engines write them (the gateway's side, blocking)."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    def read(
        self, request_id: str, last_id: str = "0-0", block_ms: int = 0
    ) -> list[tuple[str, ResponseEvent]]:
        """Events after `last_id`, as written (duplicates included).

        block_ms=0 returns at once (unlike Redis, where BLOCK 0 waits forever).
        Raises ProtocolError on an event it cannot read (gateway and engine speak
        different protocol versions).
        """
        if block_ms < 0:
            raise ValueError(f"block_ms must be >= 0, got {block_ms}")
        stream = self.keys.response_stream(request_id)
        reply = self.client.xread({stream: last_id}, block=block_ms or None)
        events: list[tuple[str, ResponseEvent]] = []
        for _name, entries in reply or []:
            for entry_id, fields in entries:
                events.append((as_text(entry_id), ResponseEvent.from_fields(fields)))
        return events

    def events(
        self, request_id: str, timeout: float, *, last_id: str = "0-0"
    ) -> Iterator[ResponseEvent]:
        """Yield the events a client should see, in order, ending with the final one.

        Raises TimeoutError when `timeout` seconds pass without any new event (a
        whole generation can take far longer than one wait, so the limit is per
        event, not for the whole response).
        """
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        dedup = ResponseDeduplicator()
        last_event_at = time.monotonic()
        while True:
            left = timeout - (time.monotonic() - last_event_at)
            if left <= 0:
                raise TimeoutError(f"no response event for request {request_id!r} in {timeout:g} s")
            # Short waits: a blocking read longer than the client's socket timeout
            # (5 s by default in redis-py) fails instead of waiting.
            wait_ms = max(1, min(int(left * 1000), MAX_BLOCK_MS))
            batch = self.read(request_id, last_id, block_ms=wait_ms)
            if batch:
                last_event_at = time.monotonic()
            for entry_id, event in batch:
                last_id = entry_id
                passed = dedup.accept(event)
                if passed is not None:
                    yield passed
                if dedup.done:
                    return
