"""ModelDirectory: which models have live engines, from the registry, briefly cached.

Asking the registry costs two round trips; a request path that did so every
time would spend them for an answer that changes every few seconds at most
(an engine's entry lives 10 s past its last heartbeat). Concurrent requests
share one refresh.
"""

from __future__ import annotations

import asyncio
import time

from tandem.gateway.broker import Broker
from tandem.protocol import EngineInfo

# A model missing from the cache triggers a refresh, at most this often: an
# engine that just started is found at once, unknown names cost little.
_MISS_REFRESH_S = 0.1


class ModelDirectory:
    def __init__(self, broker: Broker, ttl_s: float) -> None:
        self.broker = broker
        self.ttl_s = ttl_s
        self._models: dict[str, list[EngineInfo]] = {}
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()

    async def models(self, *, max_age: float | None = None) -> dict[str, list[EngineInfo]]:
        """Live engines by served model name."""
        max_age = self.ttl_s if max_age is None else max_age
        if time.monotonic() - self._fetched_at <= max_age:
            return self._models
        async with self._lock:
            if time.monotonic() - self._fetched_at > max_age:  # nobody refreshed meanwhile
                by_model: dict[str, list[EngineInfo]] = {}
                for info in await self.broker.live_engines():
                    by_model.setdefault(info.model, []).append(info)
                self._models = by_model
                self._fetched_at = time.monotonic()
        return self._models

    async def is_live(self, model: str) -> bool:
        if model in await self.models():
            return True
        return model in await self.models(max_age=_MISS_REFRESH_S)

    def label(self, model: str) -> str:
        """The model's name for metric labels if it is served, else "unknown"."""
        return model if model in self._models else "unknown"
