"""The engine's side of the work queue: Redis streams read through a consumer group.

NORMAL and PROMPT engines take WorkItems from the model's work streams (one per
priority, group WORK_GROUP); COMPLETION engines take Handoffs from the handoff
streams (one per priority too, group HANDOFF_GROUP). One `pull` is one Lua script,
so one round trip:

1. reclaim entries that stayed pending longer than `claim_idle_ms` (their engine
   died), highest priority first, counting each delivery;
2. read new entries (">"), highest priority first, never more than `max_items`;
3. lower the model's queued-tokens counter by what the new entries carried.

The script runs atomically, so two engines never claim the same idle entry and
the delivery counts it reports are exact.

Acked entries are deleted (XACK + XDEL in one MULTI) instead of trimming the
stream with MAXLEN on the producer side: MAXLEN would silently drop queued
requests whenever the backlog outgrows the cap, and a backlog is exactly what
the autoscaler is meant to see. With every acked entry deleted, a stream holds
only waiting and pending entries, so on Redis 6.2 (no XINFO lag)
`waiting = XLEN - pending`, in O(1) (see `tandem.backlog.queue_depth`, with the
producer side, `enqueue`).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tandem.backlog import TOKENS_FIELD
from tandem.engine.service.redis_outage import unavailable
from tandem.engine.service.work_queue_lua import (
    FORGET_CONSUMERS_LUA,
    HAND_BACK_LUA,
    HANDED_BACK_IDLE_MS,
    KEEP_ALIVE_LUA,
    PUBLISH_HANDOFF_LUA,
    PULL_LUA,
)
from tandem.keys import Keys
from tandem.protocol import (
    HANDOFF_GROUP,
    PRIORITIES,
    PRIORITY_NORMAL,
    RESPONSE_TTL_SECONDS,
    WORK_GROUP,
    Handoff,
    ProtocolError,
    Role,
    WorkItem,
    as_text,
)

log = logging.getLogger(__name__)

# An engine that pulled this recently is live: a pull takes no more than its share
# beside it. A busy engine pulls each step, an idle one every 50 ms; one that pulls
# nothing this long (full, stalled, gone) takes no share. A leaving one is removed.
LIVE_MS = 2_000
# The most entries of a dead predecessor handed back at a start: far more than one
# engine holds (its waiting and running requests).
_INHERITED_MAX = 10_000
# How long the marker that a request's handoff was published lives: far past any retry
# of the publish (an outage of minutes), as long as a response stream.
PUBLISHED_MARKER_TTL_S = RESPONSE_TTL_SECONDS


@dataclass(frozen=True, slots=True)
class Delivery:
    """One stream entry handed to this engine."""

    stream: str
    entry_id: str
    message: WorkItem | Handoff
    # 1 for a new entry; more when it was reclaimed from a consumer that died.
    times_delivered: int
    reclaimed: bool
    # Delivered more than max_deliveries times: answer with an error, do not run.
    exhausted: bool = False

    @property
    def request_id(self) -> str:
        if isinstance(self.message, Handoff):
            return self.message.work["request_id"]
        return self.message.request_id


@dataclass(slots=True)
class Pulled:
    """What one `pull` took. `work` is to run; the rest needs only an answer.

    exhausted: delivered more than max_deliveries times (engines kept dying on
    them): write an ErrorCode.REDELIVERY_LIMIT event, then `ack` them.
    malformed: (entry_id, why, request_id or None) of entries that cannot be read.
    Their request id, where it could still be read, is for an answer: without one the
    client waits out its whole deadline. `unreadable` are their (stream, entry_id),
    still pending: `ack_entries` them once the answers are written (acked first, an
    engine that died between lost the answer, and its client waited in silence).
    Iterating yields work, then exhausted deliveries (`Delivery.exhausted` tells
    them apart), for a loop that handles both in one place.
    """

    work: list[Delivery] = field(default_factory=list)
    exhausted: list[Delivery] = field(default_factory=list)
    malformed: list[tuple[str, str, str | None]] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)

    def __iter__(self) -> Iterator[Delivery]:
        yield from self.work
        yield from self.exhausted

    def __len__(self) -> int:
        return len(self.work) + len(self.exhausted)

    def __bool__(self) -> bool:
        """True when anything was taken, malformed entries included."""
        return bool(self.work or self.exhausted or self.malformed)


@dataclass(frozen=True, slots=True)
class Lapsed:
    """Held deliveries `keep_alive` found this engine no longer owns.

    taken: another engine reclaimed them (this one stalled): stop serving them.
    gone: pending nowhere: another engine finished them (their response stream
    ends), or Redis lost them (restarted without its data; nobody else has them).
    """

    taken: list[Delivery] = field(default_factory=list)
    gone: list[Delivery] = field(default_factory=list)


class WorkQueue:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        model: str,
        role: Role | str,
        consumer: str,
        *,
        claim_idle_ms: int = 30_000,
        max_deliveries: int = 3,
        share_with: Sequence[str] = (),
    ) -> None:
        if not model:
            raise ValueError("model must be a non-empty name")
        if not consumer:
            raise ValueError("consumer must be a non-empty name (the engine id)")
        if claim_idle_ms < 1:
            raise ValueError(f"claim_idle_ms must be at least 1, got {claim_idle_ms}")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be at least 1, got {max_deliveries}")
        if share_with and consumer not in share_with:
            raise ValueError(f"share_with must include the consumer {consumer!r} itself")
        self.role = Role(role)
        self.client = client
        self.keys = keys
        self.model = model
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        # The consumers pulling beside this one, itself included (a data-parallel
        # group's ranks): each pull takes no more than evens out what they hold.
        self.share_with = tuple(share_with)
        if self.role is Role.COMPLETION:
            self.group = HANDOFF_GROUP
            self.streams = keys.handoff_streams(model)
            self._counter: str | None = None
        else:
            self.group = WORK_GROUP
            self.streams = keys.work_streams(model)
            self._counter = keys.queued_tokens(model)
        self._pullers = keys.pullers(model, handoffs=self.role is Role.COMPLETION)
        self._pull_script = client.register_script(PULL_LUA)
        self._keep_alive_script = client.register_script(KEEP_ALIVE_LUA)
        self._hand_back_script = client.register_script(HAND_BACK_LUA)
        self._forget_script = client.register_script(FORGET_CONSUMERS_LUA)
        self._publish_script = client.register_script(PUBLISH_HANDOFF_LUA)
        self._started = False
        try:
            self.ensure_groups()
        except redis.RedisError as exc:  # a full Redis, say: the first pull makes them
            if not unavailable(exc):
                raise

    def ensure_groups(self) -> None:
        """Create the consumer groups (and streams) if missing.

        From id 0, so requests queued before the first engine started are served.
        """
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xgroup_create(stream, self.group, id="0", mkstream=True)
        created = 0
        for result in pipe.execute(raise_on_error=False):
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                raise result
            created += not isinstance(result, Exception)
        if created and self._started:  # not the first start: they vanished
            log.warning(
                "the consumer groups were gone (Redis restarted without its data?): "
                "recreated; what was queued before is lost, requests in work go on"
            )
        self._started = True

    # ------------------------------------------------------------------ take

    def pull(self, max_items: int, block_ms: int = 0) -> Pulled:
        """Take at most `max_items` entries to work on: reclaimed first, then new ones.

        Blocks up to `block_ms` only when there was nothing at all; the client's
        socket_timeout must then be longer than block_ms.
        """
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        if block_ms < 0:
            raise ValueError(f"block_ms must be >= 0, got {block_ms}")
        entries, lost, newest = self._run_pull(max_items)
        if not entries and not lost and block_ms > 0:
            # Wake up on any new entry without taking it: a blocking XREADGROUP over
            # several streams could return more than max_items and ignore priority.
            # A wake-up for an entry another engine takes first just finds nothing.
            self.client.xread(dict(zip(self.streams, newest, strict=True)), count=1, block=block_ms)
            entries, lost, newest = self._run_pull(max_items)
        return self._sort(entries, lost)

    def _run_pull(self, max_items: int) -> tuple[list[Any], list[Any], list[Any]]:
        keys = [*self.streams, *([self._counter] if self._counter else []), self._pullers]
        has_counter = "1" if self._counter else "0"
        args = [self.group, self.consumer, max_items, self.claim_idle_ms, self.max_deliveries]
        args += [has_counter, TOKENS_FIELD, LIVE_MS, len(self.share_with), *self.share_with]
        try:
            entries, lost, newest = self._pull_script(keys=keys, args=args)
        except redis.ResponseError as exc:
            # The streams vanished (Redis restarted without persistence, or a
            # FLUSHALL): recreate the groups and go on instead of failing every step.
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()
            entries, lost, newest = self._pull_script(keys=keys, args=args)
        return entries, lost, [as_text(x) for x in newest]

    def _sort(self, entries: list[Any], lost: list[Any]) -> Pulled:
        pulled = Pulled()
        for index, raw_id, flat, times, reclaimed in entries:
            stream, entry_id = self.streams[index - 1], as_text(raw_id)
            fields = {as_text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
            try:
                message = self._decode(fields)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                # ProtocolError is a ValueError; the others come from JSON that is
                # valid but not an object of the expected shape.
                why, rid = f"{stream} {entry_id}: {exc}", _request_id(fields)
                pulled.malformed.append((entry_id, why, rid))
                pulled.unreadable.append((stream, entry_id))
                continue
            exhausted = int(times) > self.max_deliveries
            delivery = Delivery(stream, entry_id, message, int(times), bool(reclaimed), exhausted)
            (pulled.exhausted if exhausted else pulled.work).append(delivery)
        for index, raw_id in lost:
            entry_id = as_text(raw_id)
            stream = self.streams[index - 1]
            pulled.malformed.append((entry_id, f"{stream} {entry_id}: deleted while pending", None))
        return pulled

    def _decode(self, fields: dict[str, Any]) -> WorkItem | Handoff:
        if self.role is Role.COMPLETION:
            handoff = Handoff.from_fields(fields)
            # Decode the inner WorkItem now: a bad one is malformed, not a mid-step crash.
            if not handoff.work_item.request_id:
                raise ProtocolError("handoff of a work item without request_id")
            return handoff
        return WorkItem.from_fields(fields)

    # ------------------------------------------------------------ bookkeeping

    def ack(self, deliveries: Iterable[Delivery]) -> int:
        """Acknowledge and delete finished entries; returns how many were pending."""
        return self.ack_entries([(d.stream, d.entry_id) for d in deliveries])

    def ack_entries(self, ids: Sequence[tuple[str, str]]) -> int:
        """Acknowledge and delete entries by (stream, entry_id): those `Pulled.unreadable`
        names, once answered; returns how many were pending."""
        if not ids:
            return 0
        by_stream: dict[str, list[str]] = defaultdict(list)
        for stream, entry_id in ids:
            by_stream[stream].append(entry_id)
        # MULTI: an entry is never deleted without its ack (a deleted entry left in
        # the PEL would be counted as pending forever).
        pipe = self.client.pipeline(transaction=True)
        for stream, entry_ids in by_stream.items():
            pipe.xack(stream, self.group, *entry_ids)
            pipe.xdel(stream, *entry_ids)
        return sum(pipe.execute()[0::2])

    def keep_alive(self, deliveries: Iterable[Delivery]) -> Lapsed:
        """Reset the idle time of entries still in work, so no engine reclaims them.

        Call every few seconds (well under claim_idle_ms) for every entry still held.
        Returns the deliveries this engine no longer owns (`Lapsed`).
        """
        results = self._per_stream(self._keep_alive_script, deliveries)
        lapsed = Lapsed()
        for held, (taken, gone) in results:
            lapsed.taken.extend(held[as_text(x)] for x in taken)
            lapsed.gone.extend(held[as_text(x)] for x in gone)
        return lapsed

    def hand_back(self, deliveries: Iterable[Delivery]) -> int:
        """Give entries this engine will not finish to the next engine that pulls, at
        once and without counting this delivery; returns how many were still its own."""
        results = self._per_stream(self._hand_back_script, deliveries, HANDED_BACK_IDLE_MS, "1")
        return sum(int(n) for _, n in results)

    def release_inherited(self) -> int:
        """Hand back, at once, the entries still pending under this engine's id from
        before it started: a process with the same id died holding them (`tandem up`
        restarts an engine under its id). Left alone they would wait the whole
        claim_idle_ms, though nobody runs them. Call once, before the first pull; the
        delivery that died still counts. Returns how many."""
        return self._release_pending(set(), counted=True)

    def release_strays(self, known: Iterable[Delivery]) -> int:
        """Hand back, at once and uncounted, entries pending under this engine's id that
        it does not know of: taken by a pull whose reply was lost (Redis ran it, then the
        connection broke, or a paused Redis ran it late). Left alone they would wait the
        whole claim_idle_ms. Returns how many."""
        return self._release_pending({(d.stream, d.entry_id) for d in known}, counted=False)

    def _release_pending(self, known: set[tuple[str, str]], *, counted: bool) -> int:
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xpending_range(stream, self.group, "-", "+", _INHERITED_MAX, self.consumer)
        pending = pipe.execute(raise_on_error=False)
        pipe = self.client.pipeline(transaction=False)
        for stream, rows in zip(self.streams, pending, strict=True):
            ids = [] if isinstance(rows, Exception) else [as_text(r["message_id"]) for r in rows]
            ids = [i for i in ids if (stream, i) not in known]
            if ids:
                uncount = "0" if counted else "1"
                args = [self.group, self.consumer, HANDED_BACK_IDLE_MS, uncount, *ids]
                self._hand_back_script(keys=[stream], args=args, client=pipe)
        return sum(int(n) for n in pipe.execute())

    def forget_consumers(self, *, leaving: bool = False) -> int:
        """Delete the group's consumers (engines) idle past claim_idle_ms with nothing
        pending, and this one too when `leaving` with nothing pending; returns how many.
        Engines that ran and went would otherwise stay listed in the group forever."""
        args = [self.group, self.claim_idle_ms, self.consumer if leaving else ""]
        if leaving:  # no share of a burst kept for it: the others take it whole
            self.client.zrem(self._pullers, self.consumer)
        return int(self._forget_script(keys=self.streams, args=args))

    def _per_stream(
        self, script: Any, deliveries: Iterable[Delivery], *args: Any
    ) -> list[tuple[dict[str, Delivery], Any]]:
        """Run a script on each stream's deliveries (ARGV: group, consumer, *args, ids),
        in one round trip; returns (those deliveries by entry id, its reply) per stream."""
        by_stream: dict[str, dict[str, Delivery]] = defaultdict(dict)
        for d in deliveries:
            by_stream[d.stream][d.entry_id] = d
        if not by_stream:
            return []
        pipe = self.client.pipeline(transaction=False)
        for stream, held in by_stream.items():
            script(keys=[stream], args=[self.group, self.consumer, *args, *held], client=pipe)
        return list(zip(by_stream.values(), pipe.execute(), strict=True))

    def publish_handoff(
        self, handoff: Handoff, source: Delivery, *, by_priority: bool = True
    ) -> bool:
        """Offer a prefilled request to the model's COMPLETION engines, and acknowledge the
        work entry `source` it came from, in one step (PUBLISH_HANDOFF_LUA). True once
        published by this engine (now, or by a try whose reply was lost); False when
        another engine has the request (it took the entry over, or handed it off).
        `by_priority`: on its priority's stream, where the decoders read it (else the
        normal one, which every decoder reads)."""
        # At its request's priority: decoders take higher ones first, as engines do work.
        priority = handoff.work.get("priority", PRIORITY_NORMAL) if by_priority else None
        keys = [
            source.stream,
            self.keys.handoff_stream(
                self.model, priority if priority in PRIORITIES else PRIORITY_NORMAL
            ),
            self.keys.handoff_published(self.model, source.request_id),
            self.keys.handoff_stream(self.model, PRIORITY_NORMAL),
        ]
        fields = [x for pair in handoff.to_fields().items() for x in pair]
        args = [self.group, self.consumer, source.entry_id, PUBLISHED_MARKER_TTL_S, *fields]
        return int(self._publish_script(keys=keys, args=args)) in (1, 2)


def _request_id(fields: dict[str, Any]) -> str | None:
    """The request id of an entry that cannot be read, if that much of it can be: a work
    item's, or a handoff's work item's."""
    try:
        data = json.loads(as_text(fields.get("data") or ""))
        rid = data.get("request_id") or (data.get("work") or {}).get("request_id")
    except (ValueError, TypeError, AttributeError):
        return None
    return rid if isinstance(rid, str) and rid else None
