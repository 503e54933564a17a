"""GatewayService: what one gateway app holds, and the path of a completion request.

Created by `create_app` and kept on `app.state.gateway`: the settings, the
keys, the metrics, one redis.asyncio client and the helpers built on it.
Nothing lives at module level, so two apps in one process (tests, two
replicas) share nothing but Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable
from typing import cast

import redis.asyncio as aioredis
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from tandem.gateway.admission import Admission, Ticket
from tandem.gateway.auth import ApiKey, KeyStore
from tandem.gateway.broker import Broker
from tandem.gateway.cancels import Cancels
from tandem.gateway.directory import ModelDirectory
from tandem.gateway.disconnect import CLIENT_GONE, ClientGone, until_disconnected
from tandem.gateway.errors import PROMPT_REFUSALS, GatewayError
from tandem.gateway.generation import Generation
from tandem.gateway.idempotency import IdempotencyLedger
from tandem.gateway.in_flight import InFlight
from tandem.gateway.jobs import IDEMPOTENCY_HEADER, Job, JobBuilder
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.quota import Quotas
from tandem.gateway.reader import AsyncResponseReader
from tandem.gateway.readiness import ReadinessLog
from tandem.gateway.recovery import LossWatch, RedisEpoch
from tandem.gateway.rendering import ChatRenderer, CompletionRenderer, Renderer
from tandem.gateway.replicas import Replicas
from tandem.gateway.scrape import ScrapeReadings
from tandem.gateway.settings import GatewaySettings
from tandem.gateway.streaming import EventStreamResponse, with_keepalive
from tandem.keys import Keys

log = logging.getLogger("tandem.gateway")
# The most a quota's give-back or settlement may add to the answer it runs on the way
# to (an error, the last of a stream): a Redis outage may not delay it longer.
_QUOTA_ASIDE_S = 1.0


class GatewayService:
    def __init__(
        self,
        settings: GatewaySettings,
        key_store: KeyStore,
        client: aioredis.Redis,
        metrics: GatewayMetrics,
        *,
        reads: aioredis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.key_store = key_store
        metrics.keys_stale_when(lambda: key_store.stale)
        self.client = client
        self.metrics = metrics
        self.keys = Keys(prefix=settings.key_prefix)
        self.jobs = JobBuilder(settings)
        self.broker = Broker(client, self.keys, reads=reads)
        self.readiness = ReadinessLog(settings.redis_url)
        self.reader = AsyncResponseReader(
            client, self.keys, block_ms=settings.read_block_ms, outage_s=settings.redis_outage_s
        )
        self.epoch = RedisEpoch(self.broker)
        self.directory = ModelDirectory(self.broker, settings.models_cache_s)
        # As old as the engine list may be (its own cache): a second at most by default.
        self.scrape = ScrapeReadings(self.directory, self.broker, metrics, settings.models_cache_s)
        self.ledger = IdempotencyLedger(client, settings.key_prefix)
        self.cancels = Cancels(self.broker, self.ledger, metrics)
        self.replicas = Replicas(
            client, self.keys, beat_s=settings.replica_beat_s, lapse_s=settings.replica_lapse_s
        )
        self.admission = Admission(
            settings,
            self.broker,
            self.directory,
            Quotas(client, settings.key_prefix),
            self.ledger,
            InFlight(client, settings.key_prefix),
            self.replicas,
        )

    async def serve(self, request: Request, caller: ApiKey, job: Job) -> Response:
        """Admit, queue, and answer one chat or completions request."""
        # The model label of the metrics (middleware.MODEL_LABEL): callers cannot
        # invent label values, an unknown name is "unknown".
        request.state.model_label = self.directory.label(job.model)
        # Before queueing: a restart after this reading is one the request may have lost.
        run_id = await self.epoch.current()
        ticket = await self.admission.admit(caller, job, request.headers.get(IDEMPOTENCY_HEADER))
        request.state.model_label = job.model
        request.state.request_id = ticket.base_id  # the x-request-id header
        request.state.rate_limits = ticket.rate_limits  # the x-ratelimit-* headers
        renderer = _renderer(job, ticket)
        arrived = cast(float, request.scope.get("state", {}).get("arrived", time.perf_counter()))
        generation = Generation(
            job,
            ticket,
            renderer,
            reader=self.reader,
            broker=self.broker,
            cancels=self.cancels,
            metrics=self.metrics,
            arrived=arrived,
            directory=self.directory,
            watch=self._loss_watch(job, ticket, run_id),
            # An attached retry took nothing: the first attempt settles its own.
            settle=None
            if ticket.attached
            else functools.partial(self._settle, caller, job, ticket),
            give_back=None
            if ticket.attached
            else functools.partial(self._give_back_all, caller, job, ticket),
            # The work's place in flight (an attached retry's too: the last reader gives
            # it back), and the tokens each attempt delivers.
            leave=functools.partial(self._done, caller, ticket),
            account=functools.partial(self.metrics.key_usage, caller.name, job.model),
        )
        try:
            if job.stream:
                return await self._stream(request, generation)
            return await self._complete(request, generation)
        except GatewayError as error:
            if error.code in PROMPT_REFUSALS and not ticket.attached:
                await self._give_back(caller, job, ticket)
            raise

    async def _done(self, caller: ApiKey, ticket: Ticket) -> None:
        """Its reader's end of the work: off this replica's work (a dead replica's is
        cancelled by another), and its key's place in flight back."""
        try:
            if ticket.ledger_key is None:
                await self.replicas.answered(ticket.request_ids, ticket.base_id)
        finally:
            await self.admission.in_flight.leave(caller, ticket.base_id)

    async def _give_back(self, caller: ApiKey, job: Job, ticket: Ticket) -> None:
        """The tokens an engine's refusal did not use: it refuses a prompt before any
        token (too long for the context, a token id outside the vocabulary), so a
        typo in max_tokens took most of a minute's tokens for a 400. The request slot
        stays taken (the request went through the queue and an engine). An attached
        retry took nothing: the first attempt gives back its own."""
        quotas = self.admission.quotas
        back = quotas.give_back(caller, ticket.charged, job.base_id, request_slot=False)
        await _quota_aside(back, "give back", job)

    async def _give_back_all(self, caller: ApiKey, job: Job, ticket: Ticket) -> None:
        """The whole quota of a request the server's stop cut before its client got any
        of it: the client retries it as a new request."""
        back = self.admission.quotas.give_back(caller, ticket.charged, job.base_id)
        await _quota_aside(back, "give back", job)

    async def _settle(self, caller: ApiKey, job: Job, ticket: Ticket, used: int) -> None:
        """Charge the tpm quota what the answer used instead of the estimate taken."""
        quotas = self.admission.quotas
        settle = quotas.settle(caller, ticket.charged, used, job.base_id)
        await _quota_aside(settle, "settle", job)

    def _loss_watch(self, job: Job, ticket: Ticket, run_id: str | None) -> LossWatch | None:
        """What queues the request's work again if Redis loses it: the job's work
        items under the request ids read (an attached request's are the first
        attempt's; the same content, as its Idempotency-Key record matched)."""
        if len(job.items) != len(ticket.request_ids):
            return None
        items = [
            item if item.request_id == rid else dataclasses.replace(item, request_id=rid)
            for item, rid in zip(job.items, ticket.request_ids, strict=True)
        ]
        return LossWatch(
            self.broker,
            self.epoch,
            items,
            ticket.entry_ids or (None,) * len(items),
            run_id,
            grace_s=self.settings.redis_loss_grace_s,
            metrics=self.metrics,
        )

    async def _complete(self, request: Request, generation: Generation) -> Response:
        try:
            body = await until_disconnected(
                request.receive, generation.complete(), generation.client_gone
            )
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:  # the server shuts down
            generation.server_stopping()
            raise
        return JSONResponse(body)

    async def _stream(self, request: Request, generation: Generation) -> Response:
        # The first event decides the status: an error before any token (a prompt
        # too long, a deadline passed in the queue) is a proper HTTP error that
        # the SDKs raise as such, not a 200 stream with an error inside.
        events = generation.events()
        try:
            first = await until_disconnected(request.receive, anext(events), generation.client_gone)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the server shuts down
                generation.server_stopping()
            # Cancelled from outside (server shutdown), the read may still be
            # unwinding: closing a running generator would raise over the real error.
            with contextlib.suppress(RuntimeError):
                await events.aclose()
            raise
        return EventStreamResponse(
            with_keepalive(generation.stream(first, events), self.settings.keepalive_s),
            generation.client_gone,
            generation.deadline,
            generation.deadline_passed,
            generation.server_stopping,
            lambda: generation.stream_failed,
        )


async def _quota_aside(call: Awaitable[None], what: str, job: Job) -> None:
    """A quota's correction on the way to an answer: _QUOTA_ASIDE_S at most, never an
    error (the answer goes out; the bucket refills, or keeps the estimate)."""
    try:
        async with asyncio.timeout(_QUOTA_ASIDE_S):
            await call
    except (RedisError, OSError) as exc:
        log.info("could not %s the quota of %s: %r", what, job.base_id, exc)


def service_of(request: Request) -> GatewayService:
    return cast(GatewayService, request.app.state.gateway)


def _renderer(job: Job, ticket: Ticket) -> Renderer:
    shared = {
        "include_usage": job.include_usage,
        "logprobs": job.logprobs,
        "per_prompt": job.choices_per_prompt,
    }
    if job.kind == "chat":
        return ChatRenderer(ticket.base_id, ticket.created, job.model, **shared)
    chars = tuple(len(item.prompt or "") for item in job.prompt_items)
    return CompletionRenderer(
        ticket.base_id, ticket.created, job.model, prompt_chars=chars, **shared
    )
