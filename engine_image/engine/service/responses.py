"""Response streams: engines write a request's events, the gateway reads them.

Each request has its own stream of ResponseEvents. Events that overlap what was
already written (an engine resumed a request another started) are dropped by
`tandem.deduplicator.ResponseDeduplicator`, which the gateway's asyncio reader
uses too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import redis

from tandem.deduplicator import ResponseDeduplicator
from tandem.keys import Keys
from tandem.protocol import (
    RESPONSE_TTL_SECONDS,
    EventKind,
    ProtocolError,
    ResponseEvent,
    as_text,
)

# Events per XRANGE when reading a whole history: bounds one reply's size.
_HISTORY_CHUNK = 1000


class WritersSeen(NamedTuple):
    """Of a stream's events past a point: who wrote them, whether one is final, the last
    entry id read."""

    writers: frozenset[str]
    final: bool
    last: str


@dataclass(frozen=True, slots=True)
class ResponseHistory:
    """What a request's stream already holds, de-duplicated."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # Set when the request already finished (or failed): do not run it again.
    final: ResponseEvent | None = None
    # Who wrote its events: engine ids, and "gateway" for a history a gateway wrote
    # when it queued the request again after Redis lost it.
    writers: frozenset[str] = frozenset()

    @property
    def next_offset(self) -> int:
        return len(self.token_ids)


class _Run:
    """Consecutive tokens events of one request and engine, buffered together (the
    flushes failed: Redis is away): sent as one event, and held as the tokens they
    carry rather than an object per step."""

    __slots__ = ("head", "logprobs", "texts", "token_ids")

    def __init__(self, head: ResponseEvent) -> None:
        self.head = head
        self.token_ids = list(head.token_ids)
        self.texts = [head.text]
        self.logprobs = None if head.logprobs is None else list(head.logprobs)

    def extend(self, event: ResponseEvent) -> bool:
        """Take `event` in, if it goes on where the run ends."""
        if (
            self.head.event != EventKind.TOKENS
            or event.event != EventKind.TOKENS
            or event.engine_id != self.head.engine_id
            or event.offset != self.head.offset + len(self.token_ids)
            or (event.logprobs is None) != (self.logprobs is None)
        ):
            return False
        self.token_ids += event.token_ids
        self.texts.append(event.text)
        if self.logprobs is not None:
            self.logprobs += event.logprobs
        return True

    def event(self) -> ResponseEvent:
        return dataclasses.replace(
            self.head, token_ids=self.token_ids, text="".join(self.texts), logprobs=self.logprobs
        )


class ResponseWriter:
    """Buffers an engine step's events and sends them in one pipeline.

    Tokens events of a request that follow on from the last one buffered for it are
    merged into it: while Redis is away the buffer grows with the tokens generated,
    not with the steps, and is written as one event per request once it is back.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        engine_id: str,
        *,
        ttl_seconds: int = RESPONSE_TTL_SECONDS,
    ) -> None:
        if not engine_id:
            raise ValueError("engine_id must be non-empty")
        if ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be at least 1, got {ttl_seconds}")
        self.client = client
        self.keys = keys
        self.engine_id = engine_id
        self.ttl_seconds = ttl_seconds
        self._buffer: list[tuple[str, ResponseEvent | _Run]] = []
        self._last: dict[str, int] = {}  # request id -> where its last event is buffered

    def __len__(self) -> int:
        """Events buffered and not yet flushed."""
        return len(self._buffer)

    def add(self, request_id: str, event: ResponseEvent) -> None:
        if not request_id:
            raise ValueError("request_id must be non-empty")
        if event.offset < 0:
            raise ValueError(f"event offset must be >= 0, got {event.offset}")
        if not event.engine_id:
            event = dataclasses.replace(event, engine_id=self.engine_id)
        at = self._last.get(request_id)
        if at is not None:
            last = self._buffer[at][1]
            run = last if isinstance(last, _Run) else _Run(last)
            if run.extend(event):
                self._buffer[at] = (request_id, run)
                return
        self._last[request_id] = len(self._buffer)
        self._buffer.append((request_id, event))

    def discard(self, request_id: str) -> None:
        """Forget the unsent events of a request another engine now owns: written after
        the new owner's, they would be stale (readers drop them by offset, but they
        would renew the stream's life)."""
        if request_id not in self._last:
            return
        kept = [entry for entry in self._buffer if entry[0] != request_id]
        self._buffer = kept
        self._last = {rid: at for at, (rid, _) in enumerate(kept)}

    def flush(self) -> int:
        """Send every buffered event, in order; returns how many were sent.

        On a Redis error the buffer is kept and the error raised: flushing again
        may repeat events that did get through, which readers drop by offset.
        """
        if not self._buffer:
            return 0
        pipe = self.client.pipeline(transaction=False)
        streams: dict[str, None] = {}
        for request_id, item in self._buffer:
            stream = self.keys.response_stream(request_id)
            event = item.event() if isinstance(item, _Run) else item
            pipe.xadd(stream, event.to_fields())
            streams[stream] = None
        for stream in streams:
            # After the XADDs: EXPIRE on a stream that does not exist yet is a no-op.
            pipe.expire(stream, self.ttl_seconds)
        pipe.execute()
        sent = len(self._buffer)
        self._buffer.clear()
        self._last.clear()
        return sent

    def writers_after(
        self, after: Mapping[str, str]
    ) -> dict[str, tuple[frozenset[str], bool, str]]:
        """Per request id: who wrote the events of its stream past entry `after[id]`
        ("-": from the start), whether one of them is final, and the last entry id read;
        in one round trip, at most _HISTORY_CHUNK events a stream (the rest next time)."""
        pipe = self.client.pipeline(transaction=False)
        for request_id, low in after.items():
            low = low if low == "-" else f"({low}"
            stream = self.keys.response_stream(request_id)
            pipe.xrange(stream, min=low, max="+", count=_HISTORY_CHUNK)
        seen = {}
        for (request_id, last), chunk in zip(after.items(), pipe.execute(), strict=True):
            writers, final = set(), False
            for entry_id, fields in chunk:
                last = as_text(entry_id)
                with contextlib.suppress(ProtocolError):  # history() names it, if it must
                    event = ResponseEvent.from_fields(fields)
                    writers.add(event.engine_id)
                    final = final or event.is_final
            seen[request_id] = WritersSeen(frozenset(writers), final, last)
        return seen

    def history(self, request_id: str) -> ResponseHistory:
        """What was already sent for a request (by any engine), de-duplicated.

        An engine taking over a re-delivered request skips it when `final` is set,
        else resumes at `next_offset`. Raises ProtocolError on an unreadable event:
        resuming from a history it cannot read could repeat or drop tokens.
        """
        dedup = ResponseDeduplicator()
        stream = self.keys.response_stream(request_id)
        low, writers = "-", set()
        while not dedup.done:
            chunk = self.client.xrange(stream, min=low, max="+", count=_HISTORY_CHUNK)
            for entry_id, fields in chunk:
                try:
                    event = ResponseEvent.from_fields(fields)
                except ProtocolError as exc:
                    raise ProtocolError(
                        f"{request_id}'s response stream {stream} holds an unreadable event "
                        f"{as_text(entry_id)} ({exc})"
                    ) from None
                writers.add(event.engine_id)
                dedup.accept(event)
                low = f"({as_text(entry_id)}"
            if len(chunk) < _HISTORY_CHUNK:
                break
        return ResponseHistory(list(dedup.token_ids), dedup.text, dedup.final, frozenset(writers))
