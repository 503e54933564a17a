"""RedisWrites: what the engine loop writes to Redis after each step, and when.

In the one safe order: events flushed, handoffs published, then the entries whose
outcome is now written acknowledged; every few seconds, the held entries kept
alive and the registry heartbeat. While Redis is away (RedisOutage) all of it
waits, in order, and is retried with backoff; when Redis answers again the held
entries are claimed back before anything else (after a long outage they look
idle to other engines), then the registry is told, then the backlog is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from tandem.engine.service.handoff_flow import HandoffFlow
from tandem.engine.service.heartbeat import Heartbeat
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.redis_outage import RedisOutage, unavailable
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.work_queue import Delivery
from tandem.protocol import ProtocolError
from tandem.registry_entry import EngineInfo

log = logging.getLogger(__name__)


class RedisWrites:
    def __init__(
        self,
        io: RedisIO,
        settings: WorkerSettings,
        heartbeat: Heartbeat,
        handoffs: HandoffFlow | None,
        *,
        held: Callable[[], list[Delivery]],
        untaken: Callable[[], list[Delivery]],
        lost: Callable[[Delivery, bool], None],
        info: Callable[[], EngineInfo],
        orphans: Callable[[], list[Delivery]],
    ) -> None:
        """held(): the deliveries to keep alive. untaken(): those pulled and not taken
        yet (Redis went away as they were; the list itself, which a rejoin shortens).
        orphans(): those held whose entry Redis lost (lost(..., False) said so).
        lost(delivery, elsewhere): one held is not this engine's any more: another
        engine took it over or finished it (elsewhere=True: drop it), or Redis lost it
        (False: nobody else will serve it).
        info(): the registry entry to send now."""
        self.io, self.settings, self.heartbeat, self.handoffs = io, settings, heartbeat, handoffs
        self._held, self._untaken, self._lost, self._info = held, untaken, lost, info
        self._orphans = orphans
        # Per orphan, the last entry of its stream looked at: each keep-alive reads on.
        self._orphans_read: dict[str, str] = {}
        self.outage = RedisOutage(io.writable)
        # Entries to acknowledge once the events before them are written.
        self.to_ack: list[Delivery] = []
        self._last_keep_alive = self._last_heartbeat = 0.0

    @property
    def unwritten(self) -> bool:
        """Events or acks still to write (an unpublished handoff's ack waits for it)."""
        return bool(len(self.io.responses) or self.to_ack)

    def holding(self, running: int) -> str:
        return (
            f"{running} requests running, {len(self.io.responses)} events "
            f"and {len(self.to_ack)} acks to write"
        )

    def after_step(self, running: int) -> None:
        """Write; while Redis is away, only once a PING answered again."""
        outage = self.outage
        if not outage.may_try():
            return
        try:
            if outage.down:
                self._rejoin()
            backlog = len(self.io.responses)
            # The keep-alive first: after a stall (a stopped process, a long step)
            # another engine may own some of ours; publishing their handoffs first had
            # a second decoder serve them again.
            self._periodic()
            self._write()
        except redis.RedisError as exc:
            if not unavailable(exc):
                raise
            outage.failed(exc, self.holding(running))
            return
        outage.recovered(f"wrote the {backlog} events held back; {self.holding(running)}")

    def beat_soon(self) -> None:
        """The registry entry changed (draining): send it now, else at the next turn."""
        self._last_heartbeat = 0.0
        if not self.outage.down:
            # Unreachable: the loop notices, and tells the registry once Redis is back.
            try:
                self.heartbeat.beat(self._info())
            except redis.RedisError as exc:
                if not unavailable(exc):
                    raise

    def hand_back(self, left: list[Delivery], running: int, why: str) -> None:
        """The engine stops (`why`, for the log): write what is left, and give the
        unfinished entries back so that the next engine to pull resumes them now, not
        after --claim-idle-ms."""
        if self.outage.down and not self.io.ping():
            self._stranded("no answer to PING", running)
            return
        try:
            self._write()  # the tokens so far first: the next engine resumes after them
            if left:
                log.info("%s: handed %d requests back", why, self.io.queue.hand_back(left))
        except redis.RedisError as exc:
            if not unavailable(exc):
                raise
            self._stranded(exc, running)

    def _stranded(self, why: object, running: int) -> None:
        if not running and not self.unwritten:
            log.info("stopping with Redis unreachable (%s): nothing was held", why)
            return
        log.warning(
            "stopping with Redis unreachable (%s): %s are lost; if Redis keeps their "
            "entries, other engines take the unfinished requests over after --claim-idle-ms",
            why,
            self.holding(running),
        )

    def _write(self) -> None:
        self.io.responses.flush()
        if self.handoffs is not None:
            self.handoffs.publish_pending(self.io)
        if self.to_ack:
            self.io.queue.ack(self.to_ack)
            self.to_ack.clear()

    def _served_elsewhere(self, request_id: str) -> bool:
        """Whether another writer shows in the request's stream (an engine that took it
        over, a gateway that queued it again after Redis lost it), or its end: that one
        serves it now, and this engine's unwritten events are stale. Only its own: Redis
        lost the entry, and this engine goes on (its final event included)."""
        try:
            history = self.io.responses.history(request_id)
        except ProtocolError as exc:  # a writer of another version: not this engine
            log.warning("%s: %s; taken as served elsewhere", request_id, exc)
            return True
        return history.final is not None or bool(history.writers - {self.settings.engine_id})

    def _drop_orphans_served_elsewhere(self) -> None:
        """Requests whose entry Redis lost with its data go on here until another
        writer shows in their stream: a gateway that queued one again (its history),
        then the engine that took the new entry. Looked at once, they ran to the end on
        both engines (KV and a slot held for an answer the client had from the other)."""
        orphans = {d.request_id: d for d in self._orphans()}
        self._orphans_read = {rid: self._orphans_read.get(rid, "-") for rid in orphans}
        if not orphans:
            return
        for rid, (writers, final, last) in self.io.responses.writers_after(
            self._orphans_read
        ).items():
            self._orphans_read[rid] = last
            if final or writers - {self.settings.engine_id}:
                log.info("%s is served elsewhere now (queued again): dropped", rid)
                self._lost(orphans[rid], True)

    def _rejoin(self) -> None:
        self.io.queue.ensure_groups()  # Redis may be back without its data
        # A pull whose reply the outage lost left entries pending here that nobody runs.
        known = [*self._held(), *self._untaken(), *self.to_ack]
        strays = self.io.queue.release_strays(known)
        if strays:
            log.info("handed back %d entries a pull took as Redis went away", strays)
        self._still_own_untaken()
        self._last_keep_alive = self._last_heartbeat = 0.0
        self._periodic()

    def _still_own_untaken(self) -> None:
        """Drop the entries pulled and not taken that are not this engine's any more: an
        outage past --claim-idle-ms let another engine take them over (taken here too,
        both served them, and a sampled answer's stream mixed two runs), or finished
        them. Nothing of them runs here yet, so nothing else is to stop; those left are
        kept alive until taken."""
        untaken = self._untaken()
        if not untaken:
            return
        lapsed = self.io.queue.keep_alive(untaken)
        for delivery in [*lapsed.taken, *lapsed.gone]:
            untaken.remove(delivery)
        if lapsed.taken or lapsed.gone:
            ids = ", ".join(d.request_id for d in [*lapsed.taken, *lapsed.gone])
            log.info("%s, pulled as Redis went away, are another engine's now: left to it", ids)

    def _periodic(self) -> None:
        now = time.monotonic()
        if now - self._last_keep_alive > self.settings.keep_alive_every:
            # The entries about to be acknowledged too: a request that ended (or was
            # offered) in a step that stalled past the claim timeout may be another's.
            lapsed = self.io.queue.keep_alive([*self._held(), *self.to_ack])
            if lapsed.taken:
                ids = ", ".join(d.request_id for d in lapsed.taken)
                log.info("another engine took over %s while this one stalled: dropped", ids)
            for delivery in lapsed.taken:  # we stalled and another engine took it over
                if delivery in self.to_ack:  # its entry is the new owner's to acknowledge
                    self.to_ack.remove(delivery)
                self._lost(delivery, True)
            # Finished elsewhere (taken over while this one stalled), or lost with
            # Redis's data: the epoch tells (the response stream may have expired).
            kept = bool(lapsed.gone) and self.io.epoch.kept()
            if kept:
                ids = ", ".join(d.request_id for d in lapsed.gone)
                log.info("%s finished elsewhere while this engine stalled: dropped", ids)
            for delivery in lapsed.gone:
                elsewhere = kept or self._served_elsewhere(delivery.request_id)
                if elsewhere and delivery in self.to_ack:
                    self.to_ack.remove(delivery)
                self._lost(delivery, elsewhere)
            self._drop_orphans_served_elsewhere()
            self._last_keep_alive = now
        if now - self._last_heartbeat > self.settings.heartbeat_every:
            self.heartbeat.beat(self._info())
            self._last_heartbeat = now
