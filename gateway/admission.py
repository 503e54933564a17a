"""Admission: whether a request is queued, attached to earlier work, or refused.

In order, cheapest and most telling first: the key may use the model (403),
an engine serves it (404) with the roles to finish a request, unless a
controller declares it (503), an Idempotency-Key already has work (attach),
the key has a place in flight (429), the model's queue has room (429), the key's
quotas allow it (429). Only then is the work queued. Quota is taken last so a
request refused for any other reason costs the caller nothing.

The queue limit compares a model's backlog (`queue_depth(...).total_waiting`)
with --max-queue. Reading it costs a 9-command transaction, so a reading is
reused for `queue_check_interval_s` (50 ms), plus what this replica queued
since and what it is queueing now (room is reserved as the check passes, so
a burst of concurrent requests cannot all pass on one reading): under load
that saves most reads, and the count never misses this replica's own
admissions. Only a fresh reading refuses. Other replicas'
admissions are seen at the next reading, so replicas admitting at the same
instant may overshoot the limit by a few entries: it sheds load, it is not an
exact cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from tandem.gateway.auth import ApiKey, check_model
from tandem.gateway.broker import Broker
from tandem.gateway.context_check import check_context
from tandem.gateway.directory import ModelDirectory
from tandem.gateway.errors import (
    bad_request,
    missing_role,
    model_not_found,
    rate_limited,
    unavailable,
)
from tandem.gateway.idempotency import IdempotencyLedger, IdempotencyRecord
from tandem.gateway.in_flight import InFlight, in_flight_refusal
from tandem.gateway.jobs import Job
from tandem.gateway.quota import Quotas
from tandem.gateway.replicas import Replicas
from tandem.gateway.settings import GatewaySettings
from tandem.protocol import PRIORITY_NORMAL

# Retry-After of a model whose engines lack a role: an engine starts in seconds.
MISSING_ROLE_RETRY_S = 5
# Retry-After while older engines are replaced (a rolling upgrade: a pod's model loads).
OUTDATED_RETRY_AFTER_S = 30


@dataclass(frozen=True)
class Ticket:
    """An admitted request: the work items to read and the answer's identity."""

    base_id: str
    created: int
    request_ids: list[str]
    # time.monotonic() when queued (or attached).
    enqueued_at: float
    # Set when it reads an earlier attempt's work (Idempotency-Key).
    attached: bool = False
    # The Idempotency-Key record to drop if the gateway cancels the work.
    ledger_key: str | None = None
    # The work entries' ids, per request id (None: attached, not known here).
    entry_ids: tuple[str | None, ...] = ()
    # The tokens the tpm quota took for it (0: attached, the first attempt took them).
    charged: int = 0
    # Its answer's x-ratelimit-* headers: the key's quotas after it (none: attached, or
    # a key without quotas).
    rate_limits: dict[str, str] = field(default_factory=dict)


@dataclass
class _Backlog:
    read_at: float
    waiting: int
    queued_since: int = 0


class QueueGauge:
    """A model's waiting entries, read from Redis at most every `max_age_s`.

    Concurrent requests that find the reading stale share one read, so a burst
    does not turn into a burst of transactions.
    """

    def __init__(self, broker: Broker, max_age_s: float) -> None:
        self.broker = broker
        self.max_age_s = max_age_s
        self._backlogs: dict[str, _Backlog] = {}
        self._reads: dict[str, asyncio.Future[_Backlog]] = {}
        # Entries of admissions past the check, not yet queued (their quota, their XADD).
        self._reserved: dict[str, int] = {}
        # Entries queued while a read of the model is in flight: its snapshot may have
        # been taken before their XADD, so the reading counts them (twice at worst, a
        # refusal one early; counted nowhere, the queue went past its limit).
        self._queued_during_read: dict[str, int] = {}

    async def reserve(self, model: str, count: int, limit: int) -> int | None:
        """Room for `count` entries if fewer than `limit` wait: reserved until
        `settle`, and None; else how many wait (refuse the request)."""
        waiting = await self.waiting(model, limit)
        if waiting >= limit:
            return waiting
        # No await since the reading: no other admission can pass on it too.
        self._reserved[model] = self._reserved.get(model, 0) + count
        return None

    def settle(self, model: str, count: int, *, queued: bool) -> None:
        """A reservation's admission ended: its entries queued, or not (refused by
        its quota, or Redis failed)."""
        left = self._reserved.pop(model) - count
        if left:
            self._reserved[model] = left
        if queued:
            self.queued(model, count)

    async def waiting(self, model: str, limit: int) -> int:
        """The model's waiting entries, read afresh whenever the estimate reaches
        `limit`: entries queued since the last reading may be taken already, so
        only a fresh reading may refuse a request."""
        backlog = self._backlogs.get(model)
        stale = backlog is None or time.monotonic() - backlog.read_at > self.max_age_s
        if stale or self._estimate(model, backlog) >= limit:
            backlog = await self._fresh(model)
        return self._estimate(model, backlog)

    def _estimate(self, model: str, backlog: _Backlog) -> int:
        return backlog.waiting + backlog.queued_since + self._reserved.get(model, 0)

    async def _fresh(self, model: str) -> _Backlog:
        read = self._reads.get(model)
        if read is None:
            read = self._reads[model] = asyncio.ensure_future(self._read(model))
            read.add_done_callback(lambda _: self._reads.pop(model, None))
        return await asyncio.shield(read)

    async def _read(self, model: str) -> _Backlog:
        self._queued_during_read[model] = 0
        try:
            depth = await self.broker.queue_depth(model)
        finally:
            during = self._queued_during_read.pop(model)
        backlog = _Backlog(time.monotonic(), depth.total_waiting, queued_since=during)
        self._backlogs[model] = backlog
        return backlog

    def queued(self, model: str, count: int) -> None:
        backlog = self._backlogs.get(model)
        if backlog is not None:
            backlog.queued_since += count
        if model in self._queued_during_read:
            self._queued_during_read[model] += count


class Admission:
    def __init__(
        self,
        settings: GatewaySettings,
        broker: Broker,
        directory: ModelDirectory,
        quotas: Quotas,
        ledger: IdempotencyLedger,
        in_flight: InFlight,
        replicas: Replicas,
    ) -> None:
        self.settings = settings
        self.broker = broker
        self.directory = directory
        self.quotas = quotas
        self.ledger = ledger
        self.in_flight = in_flight
        self.replicas = replicas
        self.queues = QueueGauge(broker, settings.queue_check_interval_s)

    async def admit(self, caller: ApiKey, job: Job, idempotency_key: str | None) -> Ticket:
        check_model(caller, job.model)  # first, as retrieve_model: nothing of other models
        if not await self.directory.is_served(job.model):
            # A Redis that refuses writes (full, say) lets the engines' registry entries
            # lapse: that is a 503 to retry, not a model that does not exist.
            await self.broker.check_writable()
            served = await self.directory.served_for(caller)
            raise model_not_found(job.model, served, limited=caller.models is not None)
        if (gap := await self.directory.missing_role(job.model)) is not None:
            raise missing_role(job.model, *gap, MISSING_ROLE_RETRY_S)
        check_context(job, self.directory.context_length(job.model))
        if (option := job.chat_option) and not self.directory.renders_chat_options(job.model):
            raise bad_request(
                f"{option} needs engines that render chat template options, and some "
                f"engines of {job.model!r} are older (a rolling upgrade in progress?): send "
                "it once they are replaced, or without the option",
                option,
                "unsupported",
            )
        if job.items[0].cache_salt is not None and not self.directory.salts_prefix_cache(job.model):
            # Not the client's doing (a key's prefix_cache: own salts every request): a
            # rollout's, which passes. Run on an older engine, it would share its cache.
            raise unavailable(
                f"Some engines of {job.model!r} are older than prefix-cache isolation "
                "(cache_salt, or the API key's prefix_cache: own), and would share cached "
                "prompts across tenants: a rolling upgrade in progress; retry once they are "
                "replaced",
                "engines_outdated",
                OUTDATED_RETRY_AFTER_S,
            )
        ledger_key = None
        if idempotency_key is not None:
            ledger_key = self.ledger.key(caller.name, idempotency_key)
            mine = IdempotencyRecord(job.base_id, job.request_ids, job.created, job.digest)
            first = await self.ledger.claim(ledger_key, mine, job.timeout)
            if first is not None:
                return Ticket(
                    first.base_id,
                    first.created,
                    first.request_ids,
                    time.monotonic(),
                    attached=True,
                    ledger_key=ledger_key,
                )
        try:
            entry_ids, charge, rate_limits = await self._queue(caller, job, ledger_key is None)
        except BaseException:
            if ledger_key is not None:  # nothing queued: a retry must queue afresh
                with contextlib.suppress(Exception):  # the first error is the one to report
                    await self.ledger.release(ledger_key, job.base_id)
            raise
        if ledger_key is not None:
            # Queued: unmarked (Redis failing just now), a retry waits PENDING_WAIT_S,
            # then takes the record over and queues the work a second time.
            with contextlib.suppress(RedisError, OSError):
                await self.ledger.queued(ledger_key, mine)
        return Ticket(
            job.base_id,
            job.created,
            job.request_ids,
            time.monotonic(),
            ledger_key=ledger_key,
            entry_ids=tuple(entry_ids),
            charged=charge,
            rate_limits=rate_limits,
        )

    async def _queue(
        self, caller: ApiKey, job: Job, alone: bool
    ) -> tuple[list[str], int, dict[str, str]]:
        """Take the key's place in flight, the queue's room and the key's quota, then queue
        the work (`alone`: no retry can attach to it, and it is noted as this replica's):
        its entry ids, the tokens charged and the key's rate-limit headers. What was
        taken is given back if a later step fails: a refused request costs nothing."""
        entered = reserved = charged = noted = False
        try:
            entered = True  # a reply lost after the script ran holds a place: given back
            if (count := await self.in_flight.enter(caller, job.base_id, job.timeout)) is not None:
                entered = False
                raise in_flight_refusal(caller, count)
            await self._reserve_room(job)
            reserved = True
            context = self.directory.context_length(job.model)
            charge = job.cost_tokens(context)
            default = None if job.max_tokens_given else job.counted_max_tokens(context)
            rate_limits = await self.quotas.admit(caller, charge, job.base_id, job.timeout, default)
            charged = True
            if alone:
                noted = True
                place = (caller.name, job.base_id) if caller.max_in_flight is not None else None
                await self.replicas.answering(job.request_ids, place)
            entry_ids = await self.broker.enqueue(job.items)
        except BaseException:
            if reserved:
                self.queues.settle(job.model, job.n, queued=False)
            # The first error is the one to report.
            if charged:
                with contextlib.suppress(Exception):
                    await self.quotas.give_back(caller, charge, job.base_id)
            if entered:
                with contextlib.suppress(Exception):
                    await self.in_flight.leave(caller, job.base_id)
            if noted:
                with contextlib.suppress(Exception):
                    await self.replicas.answered(job.request_ids, job.base_id)
            raise
        self.queues.settle(job.model, job.n, queued=True)
        return entry_ids, charge, rate_limits

    async def _reserve_room(self, job: Job) -> None:
        limit = queue_limit(self.settings.max_queue, job.items[0].priority)
        waiting = await self.queues.reserve(job.model, job.n, limit)
        if waiting is not None:
            low = " for low priority (half of it)" if limit < self.settings.max_queue else ""
            raise rate_limited(
                f"The queue of model {job.model!r} is full{low} ({waiting} requests waiting, "
                f"each of n choices one; limit {limit}); retry later",
                "queue_full",
                self.settings.queue_retry_after_s,
            )


def queue_limit(max_queue: int, priority: int) -> int:
    """The backlog past which a request of `priority` is shed: --max-queue, and half of it
    for low priority, so that the room left stays the others' (a key held to low
    priority filled the queue, and every tenant's high-priority request was refused)."""
    return max_queue if priority >= PRIORITY_NORMAL else (max_queue + 1) // 2
