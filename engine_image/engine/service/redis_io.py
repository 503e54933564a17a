"""RedisIO: everything the engine loop says to Redis, behind one object."""

from __future__ import annotations

import contextlib

import redis

from tandem.engine.service import cancellation
from tandem.engine.service.cancellation import CancelListener
from tandem.engine.service.registry import Registry
from tandem.engine.service.responses import ResponseWriter
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.work_queue import WorkQueue
from tandem.protocol import EngineInfo, Keys


class RedisIO:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        settings: WorkerSettings,
        listener: CancelListener,
    ) -> None:
        self.client = client
        self.keys = keys
        self.queue = WorkQueue(
            client,
            keys,
            settings.model_name,
            settings.role,
            settings.engine_id,
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
        )
        self.responses = ResponseWriter(client, keys, settings.engine_id)
        self.registry = Registry(client, keys)
        self._listener = listener

    def cancelled(self, held: list[str]) -> set[str]:
        """Request ids cancelled since the last call (from the pub/sub listener).

        After a dropped subscription, notices sent meanwhile are lost: then the
        requests this engine holds are checked against the cancel keys.
        """
        cancelled = self._listener.drain()
        if self._listener.take_gap() and held:
            cancelled |= cancellation.cancelled_among(self.client, self.keys, held)
        return cancelled

    def is_cancelled(self, request_id: str) -> bool:
        return cancellation.is_cancelled(self.client, self.keys, request_id)

    def heartbeat(self, info: EngineInfo) -> None:
        self.registry.heartbeat(info)

    def deregister(self, engine_id: str) -> None:
        with contextlib.suppress(redis.RedisError):  # else the entry expires on its own
            self.registry.remove(engine_id)

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        self._listener.close()
        self.client.close()
