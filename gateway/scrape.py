"""What a /metrics scrape reads from Redis, read at most once a second (by default).

/metrics needs no key (Prometheus scrapes it), and a reading costs Redis about a
dozen commands a model: every call read afresh, so anyone calling it in a loop
multiplied the load on the Redis every request goes through. Scrapes within
`every_s` of a reading, or while one runs, share it.
"""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import RedisError

from tandem.gateway.broker import Broker
from tandem.gateway.directory import ModelDirectory
from tandem.gateway.metrics import GatewayMetrics


class ScrapeReadings:
    def __init__(
        self,
        directory: ModelDirectory,
        broker: Broker,
        metrics: GatewayMetrics,
        every_s: float,
    ) -> None:
        self._directory = directory
        self._broker = broker
        self._metrics = metrics
        self._every_s = every_s
        self._reading: asyncio.Task[None] | None = None
        self._started_at = -float("inf")
        self._failed = False  # the last reading's

    async def refresh(self) -> None:
        """The metrics' Redis readings (live engines, backlogs, redis_up) brought up to
        date: by the reading running or one at most `every_s` old, else a new one. A
        caller that stops waiting (its scrape's timeout) leaves the reading running."""
        reading = self._reading
        # One that failed is not kept: Redis back, the next scrape says so.
        if reading is None or (reading.done() and (self._failed or self._age() > self._every_s)):
            self._started_at = time.monotonic()
            reading = self._reading = asyncio.ensure_future(self._read())
        await asyncio.shield(reading)

    def _age(self) -> float:
        return time.monotonic() - self._started_at

    async def _read(self) -> None:
        metrics = self._metrics
        try:
            models = await self._directory.models()
            # And those no longer served: a model scaled to zero whose declaration
            # lapsed (its operator down) still has its requests in Redis, and reading
            # 0, the alert on work without engines went silent when it was needed most.
            shown = metrics.backlog_models
            backlogs = await self._broker.queue_depths(sorted(shown | set(models)))
        except (RedisError, OSError, TimeoutError):
            self._failed = True
            metrics.redis_up(False)
        else:
            self._failed = False
            metrics.redis_up(True)
            metrics.engines(models)
            metrics.backlog(backlogs)
