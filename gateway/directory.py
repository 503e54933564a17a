"""ModelDirectory: which models are served, from the registry and the catalog, briefly cached.

A model is served when it has live engines (the registry) or a controller
declares it (tandem/catalog.py: scaled to zero, its engines start on queued
work); requests for any other name are answered 404.

Asking the registry and the catalog costs a few round trips; a request path that did so every
time would spend them for an answer that changes every few seconds at most
(an engine's entry lives 10 s past its last heartbeat). Concurrent requests
share one refresh.
"""

from __future__ import annotations

import asyncio
import time

from tandem.gateway.broker import Broker
from tandem.gateway.metrics import UNKNOWN_MODEL
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
        """Live engines by served model name; a declared model without any maps to []."""
        max_age = self.ttl_s if max_age is None else max_age
        if time.monotonic() - self._fetched_at <= max_age:
            return self._models
        async with self._lock:
            if time.monotonic() - self._fetched_at > max_age:  # nobody refreshed meanwhile
                declared = await self.broker.declared_models()
                by_model: dict[str, list[EngineInfo]] = {name: [] for name in declared}
                for info in await self.broker.live_engines():
                    by_model.setdefault(info.model, []).append(info)
                self._models = by_model
                self._fetched_at = time.monotonic()
        return self._models

    async def is_served(self, model: str) -> bool:
        if model in await self.models():
            return True
        return model in await self.models(max_age=_MISS_REFRESH_S)

    def label(self, model: str) -> str:
        """The model's name for metric labels if it is served, else "unknown"."""
        return model if model in self._models else UNKNOWN_MODEL
