"""RedisIO: everything the engine loop says to Redis, behind one object."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import redis

from tandem.engine.service import cancellation
from tandem.engine.service.cancellation import CancelListener
from tandem.engine.service.data_epoch import DataEpoch
from tandem.engine.service.redis_outage import unavailable
from tandem.engine.service.registry import Registry
from tandem.engine.service.responses import ResponseWriter
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.work_queue import WorkQueue
from tandem.keys import Keys
from tandem.protocol import Role
from tandem.registry_entry import EngineInfo

log = logging.getLogger(__name__)

# The write probe's key outlives a probe by far, and an engine by little.
_PROBE_TTL_MS = 10_000
# How often a prompt engine reads which handoff streams the decoders read: a registry
# read (every engine's entry) per handoff would cost more than the handoff.
_DECODERS_EVERY_S = 5.0


class RedisIO:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        settings: WorkerSettings,
        listener: CancelListener,
        *,
        probe: redis.Redis | None = None,
    ) -> None:
        self.client = client
        # PINGs that must answer quickly (/readyz, the loop's retries while Redis is
        # away): a client with a short timeout and no retries of its own.
        self.probe = probe or client
        self.keys = keys
        self.engine_id = settings.engine_id
        self.queue = WorkQueue(
            client,
            keys,
            settings.model_name,
            settings.role,
            settings.engine_id,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
            share_with=settings.group,
        )
        self.responses = ResponseWriter(client, keys, settings.engine_id)
        self.registry = Registry(client, keys)
        self.epoch = DataEpoch(client, keys)
        self._listener = listener
        self._recheck = False  # a gap in the notices whose keys are not checked yet
        # decoders_read_priorities' last answer, and when it was read (monotonic s).
        self._decoders_read_priorities = True
        self._decoders_read_at: float | None = None

    def start(self) -> None:
        """Before the first pull: what a dead process with this engine id left pending
        goes back to the queue now, not after --claim-idle-ms, and engines long gone
        leave the consumer group (work_queue.py)."""
        try:
            self.epoch.note()
            released = self.queue.release_inherited()
            self.queue.forget_consumers()
        except redis.RedisError as exc:
            if not unavailable(exc):
                raise
            return  # Redis is away: those entries are reclaimed by the idle time
        if released:
            log.info(
                "%d request(s) an earlier engine with this id left unfinished go back to the queue",
                released,
            )

    def cancelled(self, held: Callable[[], list[str]], *, redis_up: bool = True) -> set[str]:
        """Request ids cancelled since the last call (from the pub/sub listener).

        After a dropped subscription, notices sent meanwhile are lost: then the
        requests this engine holds (`held()`, asked for only then: the loop calls
        this every turn) are checked against the cancel keys, as soon as Redis
        answers (never while `redis_up` is False: each try would wait out the
        socket timeout).
        """
        cancelled = self._listener.drain()
        self._recheck = self._listener.take_gap() or self._recheck
        if not self._recheck or not redis_up:
            return cancelled
        if held := held():
            try:
                cancelled |= cancellation.cancelled_among(self.client, self.keys, held)
            except redis.RedisError as exc:
                if not unavailable(exc):
                    raise
                return cancelled  # the loop notices the outage; checked again after it
        self._recheck = False
        return cancelled

    def is_cancelled(self, request_id: str) -> bool:
        return cancellation.is_cancelled(self.client, self.keys, request_id)

    def heartbeat(self, info: EngineInfo) -> None:
        self.registry.heartbeat(info)

    def decoders_read_priorities(self) -> bool:
        """Whether the model's live decoders all read the handoff streams of every
        priority (as of a registry read at most _DECODERS_EVERY_S old; True with none
        live: decoders of now make them as they start). One from before them reads the
        normal stream alone: after a rolled-back upgrade, high and low requests offered
        on theirs waited there for their deadlines."""
        now = time.monotonic()
        if self._decoders_read_at is None or now - self._decoders_read_at >= _DECODERS_EVERY_S:
            decoders = [
                info
                for info in self.registry.live(self.queue.model)
                if info.role == Role.COMPLETION.value
            ]
            self._decoders_read_priorities = all(d.priority_handoffs for d in decoders)
            self._decoders_read_at = now
        return self._decoders_read_priorities

    def deregister(self, engine_id: str) -> None:
        """Leave the registry, and the consumer group unless entries are still pending
        under this engine (handed back: the next engine's pull takes them)."""
        with contextlib.suppress(redis.RedisError):  # else the entry expires on its own
            self.registry.remove(engine_id)
            self.queue.forget_consumers(leaving=True)

    def ping(self) -> bool:
        try:
            return bool(self.probe.ping())
        except redis.RedisError:
            return False

    def writable(self) -> bool:
        """Whether Redis takes a write now: a PING goes through where a full Redis (or
        a failed save, a replica) still refuses every write."""
        try:
            key = self.keys.probe_key(self.engine_id)
            return bool(self.probe.set(key, "1", px=_PROBE_TTL_MS))
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._listener.close()
        self.client.close()
        if self.probe is not self.client:
            self.probe.close()
