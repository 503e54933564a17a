"""The gateway's side of the Redis protocol, on redis.asyncio.

The synchronous originals (`tandem.backlog`'s `enqueue` and `queue_depth`, the
engine package's `cancellation.cancel` and `registry.Registry.live`) take a
blocking client, which would stall the event loop. These are
their asyncio twins: the same keys, fields, atomicity and rules, from the
same constants. tests/gateway/test_broker.py checks each twin against its
original on a real Redis, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError

from tandem.backlog import (
    ENQUEUE_SCRIPT,
    WITHDRAW_SCRIPT,
    enqueue_call,
    queue_depth_commands,
    queue_state,
    withdraw_call,
)
from tandem.cancel_notice import cancel_commands
from tandem.keys import Keys
from tandem.protocol import (
    DELIVERED_RESPONSE_TTL_SECONDS,
    RESPONSE_TTL_SECONDS,
    ResponseEvent,
    WorkItem,
    as_text,
)
from tandem.queue_state import QueueState
from tandem.redaction import password_given, refused_credentials
from tandem.registry_entry import EngineInfo, read_engine_entry

log = logging.getLogger("tandem.gateway")


class Broker:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, *, reads: aioredis.Redis | None = None
    ) -> None:
        self.client = client
        # The reads admission waits on (run_id, the registry, the queues' lengths): a
        # client whose commands answer within a second (app.py), else the one client.
        self.reads = reads if reads is not None else client
        self.keys = keys
        self._enqueue = client.register_script(ENQUEUE_SCRIPT)
        self._withdraw = client.register_script(WITHDRAW_SCRIPT)

    async def unready(self, timeout_s: float) -> str | None:
        """Why Redis does not serve this gateway now, in words safe for an unauthenticated
        caller (no host, no password); None when it answers PING within timeout_s (a
        paused Redis would hold the read for the client's whole socket timeout, and
        retries)."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                await self.client.ping()
            return None
        except AuthenticationError:  # a wrong password stays wrong: not "unreachable"
            return f"Redis {refused_credentials(password_given(self.client))}"
        except (aioredis.RedisError, OSError):  # TimeoutError is an OSError
            if time.monotonic() - started >= timeout_s:
                return f"Redis did not answer within {timeout_s:g} s"
            return "Redis is unreachable"

    async def check_writable(self) -> None:
        """Raise Redis's refusal (OOM, READONLY, ...) when it takes no writes now."""
        await self.client.set(self.keys.probe_key("gateway"), 1, ex=10)

    async def run_id(self) -> str:
        """The Redis server's run_id (INFO server): a new one after every restart."""
        return as_text((await self.reads.info("server"))["run_id"])

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

    async def held(self, items: Sequence[WorkItem], entry_ids: Sequence[str | None]) -> list[bool]:
        """Whether Redis still holds each work item: its work entry (when its id is
        known), its `enqueued` marker, or its response stream.

        One pipeline, the stream read last: an engine writes an outcome (the
        stream) before it deletes the entry, so an entry missing here had its
        outcome written before the stream is read.
        """
        pipe = self.client.pipeline(transaction=False)
        for item, entry_id in zip(items, entry_ids, strict=True):
            stream = self.keys.work_stream(item.model, item.priority)
            at = entry_id or "0-0"  # unknown (an attached request): 0-0, which no entry has
            pipe.xrange(stream, at, at, count=1)
            pipe.exists(self.keys.enqueued(item.model, item.request_id))
            pipe.exists(self.keys.response_stream(item.request_id))
        found = await pipe.execute()
        return [any(found[i : i + 3]) for i in range(0, len(found), 3)]

    async def requeue(
        self, items: Sequence[WorkItem], histories: Sequence[ResponseEvent | None]
    ) -> list[str]:
        """Queue again work items Redis lost, each after the response history its
        client already has (an engine resumes after the tokens a stream holds).

        One transaction: a history written without its work would make the request
        look held (`held`) and never be queued again. Run twice, the enqueue adds
        nothing (its markers) and the second history is dropped by offset.
        """
        pipe = self.client.pipeline(transaction=True)
        for item, history in zip(items, histories, strict=True):
            if history is not None:
                stream = self.keys.response_stream(item.request_id)
                pipe.xadd(stream, history.to_fields())
                pipe.expire(stream, RESPONSE_TTL_SECONDS)
        script_keys, args = enqueue_call(self.keys, items)
        await self._enqueue(keys=script_keys, args=args, client=pipe)
        return [as_text(entry_id) for entry_id in (await pipe.execute())[-1]]

    async def queue_depth(self, model: str) -> QueueState:
        """As `backlog.queue_depth`: waiting = XLEN - pending, one MULTI snapshot."""
        return (await self.queue_depths([model]))[model]

    async def queue_depths(self, models: Sequence[str]) -> dict[str, QueueState]:
        """queue_depth of several models in one round trip (one MULTI snapshot)."""
        pipe = self.reads.pipeline(transaction=True)
        for model in models:
            queue_depth_commands(pipe, self.keys, model)
        results = await pipe.execute(raise_on_error=False)
        size = len(results) // max(1, len(models))
        return {
            model: queue_state(results[i * size : (i + 1) * size]) for i, model in enumerate(models)
        }

    async def withdraw(self, model: str, priority: int, entry_ids: Sequence[str]) -> int:
        """Delete the work entries no engine has read yet, as `backlog.withdraw`; how many."""
        if not entry_ids:
            return 0
        script_keys, args = withdraw_call(self.keys, model, priority, entry_ids)
        return int(await self._withdraw(keys=script_keys, args=args))

    async def cancel(self, request_ids: Sequence[str]) -> None:
        """As `cancellation.cancel`, for several requests in one round trip."""
        if not request_ids:
            return
        pipe = self.client.pipeline(transaction=True)
        cancel_commands(pipe, self.keys, request_ids)
        await pipe.execute()

    async def kept(self, request_ids: Sequence[str]) -> None:
        """The response streams last RESPONSE_TTL_SECONDS from now (their answer is whole,
        and retries with its Idempotency-Key read it again)."""
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.expire(self.keys.response_stream(request_id), RESPONSE_TTL_SECONDS)
        await pipe.execute()

    async def delivered(self, request_ids: Sequence[str]) -> None:
        """Shorten the response streams' lives: their readers have them whole.

        Each holds ~120 bytes a token; at the full TTL (10 min) a busy gateway's
        answers would take gigabytes of Redis long after anyone needs them.
        """
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.expire(self.keys.response_stream(request_id), DELIVERED_RESPONSE_TTL_SECONDS)
        await pipe.execute()

    async def live_engines(self, model: str | None = None) -> list[EngineInfo]:
        """As `Registry.live`: engines whose entry has not expired, sorted by id."""
        ids = sorted(as_text(x) for x in await self.reads.smembers(self.keys.engines_set))
        if not ids:
            return []
        raws = await self.reads.mget([self.keys.engine_key(i) for i in ids])
        expired = [engine_id for engine_id, raw in zip(ids, raws, strict=True) if raw is None]
        if expired:
            await self.reads.srem(self.keys.engines_set, *expired)
        engines = []
        for engine_id, raw in zip(ids, raws, strict=True):
            info = None if raw is None else read_engine_entry(engine_id, raw)
            if info is not None and (model is None or info.model == model):
                engines.append(info)
        return engines

    async def declared_models(self) -> set[str]:
        """Models a controller declared served (tandem/catalog.py), engines or not."""
        names = sorted(as_text(x) for x in await self.reads.smembers(self.keys.models_set))
        if not names:
            return set()
        raws = await self.reads.mget([self.keys.model_key(n) for n in names])
        expired = [name for name, raw in zip(names, raws, strict=True) if raw is None]
        if expired:
            await self.reads.srem(self.keys.models_set, *expired)
        return {name for name, raw in zip(names, raws, strict=True) if raw is not None}
