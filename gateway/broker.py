"""The gateway's side of the Redis protocol, on redis.asyncio.

The synchronous originals (`tandem.backlog`'s `enqueue` and `queue_depth`, the
engine package's `cancellation.cancel` and `registry.Registry.live`) take a
blocking client, which would stall the event loop. These are
their asyncio twins: the same keys, fields, atomicity and rules, from the
same constants. tests/gateway/test_broker.py checks each twin against its
original on a real Redis, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis.asyncio as aioredis

from tandem.backlog import (
    ENQUEUE_SCRIPT,
    enqueue_call,
    queue_depth_commands,
    queue_state,
)
from tandem.protocol import (
    CANCEL_TTL_SECONDS,
    EngineInfo,
    Keys,
    WorkItem,
    as_text,
    read_engine_entry,
)
from tandem.queue_state import QueueState

log = logging.getLogger("tandem.gateway")


class Broker:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._enqueue = client.register_script(ENQUEUE_SCRIPT)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (aioredis.RedisError, OSError):
            return False

    async def enqueue(self, items: Sequence[WorkItem]) -> list[str]:
        """Queue work items (the n choices of one request) atomically, each at most
        once: `backlog.ENQUEUE_SCRIPT`, which `backlog.enqueue` runs too. Redis runs it
        again when its reply was lost to a dead connection (the client's retry), and
        the items queued the first time are not queued twice."""
        if not items:
            return []
        script_keys, args = enqueue_call(self.keys, items)
        ids = await self._enqueue(keys=script_keys, args=args)
        return [as_text(entry_id) for entry_id in ids]

    async def queue_depth(self, model: str) -> QueueState:
        """As `backlog.queue_depth`: waiting = XLEN - pending, one MULTI snapshot."""
        pipe = self.client.pipeline(transaction=True)
        queue_depth_commands(pipe, self.keys, model)
        return queue_state(await pipe.execute(raise_on_error=False))

    async def cancel(self, request_ids: Sequence[str]) -> None:
        """As `cancellation.cancel`, for several requests in one round trip."""
        if not request_ids:
            return
        pipe = self.client.pipeline(transaction=True)
        for request_id in request_ids:
            if not request_id:
                raise ValueError("request_id must be non-empty")
            # MULTI: a listener told of the cancellation always finds the key too.
            pipe.set(self.keys.cancel_key(request_id), "1", ex=CANCEL_TTL_SECONDS)
            pipe.publish(self.keys.cancel_channel, request_id)
        await pipe.execute()

    async def live_engines(self, model: str | None = None) -> list[EngineInfo]:
        """As `Registry.live`: engines whose entry has not expired, sorted by id."""
        ids = sorted(as_text(x) for x in await self.client.smembers(self.keys.engines_set))
        if not ids:
            return []
        raws = await self.client.mget([self.keys.engine_key(i) for i in ids])
        expired = [engine_id for engine_id, raw in zip(ids, raws, strict=True) if raw is None]
        if expired:
            await self.client.srem(self.keys.engines_set, *expired)
        engines = []
        for engine_id, raw in zip(ids, raws, strict=True):
            info = None if raw is None else read_engine_entry(engine_id, raw)
            if info is not None and (model is None or info.model == model):
                engines.append(info)
        return engines

    async def declared_models(self) -> set[str]:
        """Models a controller declared served (tandem/catalog.py), engines or not."""
        names = sorted(as_text(x) for x in await self.client.smembers(self.keys.models_set))
        if not names:
            return set()
        raws = await self.client.mget([self.keys.model_key(n) for n in names])
        expired = [name for name, raw in zip(names, raws, strict=True) if raw is None]
        if expired:
            await self.client.srem(self.keys.models_set, *expired)
        return {name for name, raw in zip(names, raws, strict=True) if raw is not None}
