"""The engine registry: which engines are alive, for the gateway and the autoscaler.

Each engine keeps a key with a TTL alive by heartbeat (its EngineInfo as JSON)
and adds its id to one set. An engine that dies simply stops renewing its key;
readers drop its id from the set when they find the key gone.
"""

from __future__ import annotations

import dataclasses
import time

import redis

from tandem.keys import Keys
from tandem.protocol import as_text
from tandem.registry_entry import ENGINE_TTL_SECONDS, EngineInfo, engine_entry, read_engine_entry


class Registry:
    def __init__(
        self, client: redis.Redis, keys: Keys, *, ttl_seconds: float = ENGINE_TTL_SECONDS
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        self.client = client
        self.keys = keys
        self.ttl_seconds = ttl_seconds

    def heartbeat(self, info: EngineInfo) -> EngineInfo:
        """Publish (or renew) an engine's entry; returns it with heartbeat_at set to now.

        Call well within the TTL (every ttl/3 or so) so one slow beat does not
        make the engine vanish.
        """
        if not info.engine_id:
            raise ValueError("engine_id must be non-empty")
        info = dataclasses.replace(info, heartbeat_at=time.time())
        # PX: tests use sub-second TTLs. MULTI: never a set member without its key
        # having been written in the same beat.
        pipe = self.client.pipeline(transaction=True)
        pipe.set(
            self.keys.engine_key(info.engine_id),
            engine_entry(info),
            px=max(1, round(self.ttl_seconds * 1000)),
        )
        # Every beat, not just the first: a reader that found the key expired may
        # prune the id just after a late beat renewed it; the next beat heals that.
        pipe.sadd(self.keys.engines_set, info.engine_id)
        pipe.execute()
        return info

    def entry(self, engine_id: str) -> EngineInfo | None:
        """An engine's entry, if it has one that has not expired (and can be read)."""
        raw = self.client.get(self.keys.engine_key(engine_id))
        return None if raw is None else read_engine_entry(engine_id, raw)

    def remove(self, engine_id: str) -> None:
        """Leave the registry at once (a clean shutdown), without waiting for the TTL."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.engine_key(engine_id))
        pipe.srem(self.keys.engines_set, engine_id)
        pipe.execute()

    def live(self, model: str | None = None) -> list[EngineInfo]:
        """Engines whose entry has not expired, sorted by id; of one model if given."""
        ids = sorted(as_text(x) for x in self.client.smembers(self.keys.engines_set))
        if not ids:
            return []
        raws = self.client.mget([self.keys.engine_key(i) for i in ids])
        expired = [engine_id for engine_id, raw in zip(ids, raws, strict=True) if raw is None]
        if expired:
            self.client.srem(self.keys.engines_set, *expired)
        engines = []
        for engine_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                continue
            info = read_engine_entry(engine_id, raw)
            if info is not None and (model is None or info.model == model):
                engines.append(info)
        return engines

    def models(self) -> dict[str, list[EngineInfo]]:
        """Live engines grouped by the model they serve."""
        by_model: dict[str, list[EngineInfo]] = {}
        for info in self.live():
            by_model.setdefault(info.model, []).append(info)
        return by_model
