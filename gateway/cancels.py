"""Cancels: the gateway's cancellation of work, kept until Redis takes it.

A client that leaves during a Redis outage (a restart, a failover, a pause) must
still free the engine's KV: a cancel Redis does not take within the moment it may
delay another answer is kept and written when Redis answers again. The engines
re-check the cancel keys of what they run after their own reconnect
(engine cancellation.py), so a late cancel still stops the work at its next step.
Kept for RESPONSE_TTL_SECONDS at most: past that the work has long ended.

Work several clients read (attached by an Idempotency-Key) is cancelled only when
the last of them leaves (`leave`): one client's disconnect or deadline must not
end the answer another still waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from tandem.gateway.broker import Broker
from tandem.gateway.idempotency import IdempotencyLedger
from tandem.gateway.metrics import GatewayMetrics
from tandem.protocol import RESPONSE_TTL_SECONDS

log = logging.getLogger("tandem.gateway")
_ATTEMPT_S = 1.0  # the most one retry waits on a Redis that does not answer
_FIRST_RETRY_S = 0.25
_MOST_BETWEEN_S = 4.0


@dataclass(frozen=True)
class Queued:
    """Where a request's work entries were queued: those no engine has read yet go with
    its cancel (backlog.WITHDRAW_SCRIPT), and count no more against the queue."""

    model: str
    priority: int
    entry_ids: tuple[str, ...]


@dataclass(frozen=True)
class Cancel:
    """One request's work to cancel."""

    base_id: str  # the request's id (its work items' ids begin with it)
    request_ids: tuple[str, ...]  # the work items still running
    why: str  # the metrics' label: disconnect, deadline, choice_failed, ...
    ledger_key: str | None  # its Idempotency-Key record, released with it
    # Only if no other attempt reads the work: this attempt leaves the record's readers
    # first (the id is the attempt's own), and the work is cancelled only if it was the
    # last. For an attempt that could not reach Redis to leave when it ended.
    if_last_of: str | None = None
    # Its entries' place in the queue, where known (not for work it attached to).
    queued: Queued | None = None


class Cancels:
    """The gateway's cancels, written at once or, while Redis is away, retried."""

    def __init__(
        self,
        broker: Broker,
        ledger: IdempotencyLedger,
        metrics: GatewayMetrics,
        *,
        keep_s: float = RESPONSE_TTL_SECONDS,
    ) -> None:
        self.broker = broker
        self.ledger = ledger
        self.metrics = metrics
        self.keep_s = keep_s
        # (base id, the leaving attempt's id or None) -> (cancel, kept until)
        self._pending: dict[tuple[str, str | None], tuple[Cancel, float]] = {}
        self._retries: asyncio.Task[None] | None = None
        # Writes of requests whose task is being cancelled (step_aside, cancel_soon).
        self._leaving: set[asyncio.Task[None]] = set()

    async def leave(self, ledger_key: str, base_id: str, reader: str, within: float) -> int | None:
        """Attempt `reader` of shared work left: how many still read it (0: cancel it).
        None: Redis unreadable (the leave may still run; running again, it is the same)."""
        try:
            async with asyncio.timeout(within):
                return await self.ledger.leave(ledger_key, base_id, reader)
        except (RedisError, OSError):  # TimeoutError is an OSError
            return None

    async def cancel(self, cancel: Cancel, within: float) -> None:
        """Cancel now if Redis takes it within `within` s, else as soon as it does.
        Never raises: it runs on the way to another answer (an error, a disconnect)."""
        try:
            async with asyncio.timeout(within):
                await self._write(cancel)
        except (RedisError, OSError) as exc:
            ids = ", ".join(cancel.request_ids)
            log.warning("could not cancel %s (%s) yet, retrying: %r", ids, cancel.why, exc)
            self._keep(cancel)
        except asyncio.CancelledError:
            # Its task was cut mid-write (a stream cut at its deadline): the cancel was
            # decided all the same, and is written by the retries.
            self._keep(cancel)
            raise

    def _keep(self, cancel: Cancel) -> None:
        self._pending[cancel.base_id, cancel.if_last_of] = (cancel, time.monotonic() + self.keep_s)
        if self._retries is None or self._retries.done():
            self._retries = asyncio.get_running_loop().create_task(self._retry())

    def step_aside(self, ledger_key: str, base_id: str, reader: str) -> None:
        """One reader of shared work stops reading it without ending it: its server
        shuts down, and a retry through another replica attaches to the work. Counted
        out on a task of its own (the request's task is being cancelled), which close()
        waits for a moment: still counted, it kept the last reader's leaving (the
        retry's client gone too) from cancelling the work, which ran for nobody."""
        self.on_the_way_out(self._step_aside(ledger_key, base_id, reader))

    def cancel_soon(self, cancel: Cancel) -> None:
        """`cancel` on a task of its own, which close() waits for a moment: the request's
        task is being cancelled (its server shuts down)."""
        self.on_the_way_out(self.cancel(cancel, _ATTEMPT_S))

    def on_the_way_out(self, write: Coroutine[Any, Any, None]) -> None:
        """`write` on a task of its own, which close() waits for a moment (the request's
        task is being cancelled: its server shuts down)."""
        task = asyncio.get_running_loop().create_task(write)
        self._leaving.add(task)
        task.add_done_callback(self._leaving.discard)

    async def _step_aside(self, ledger_key: str, base_id: str, reader: str) -> None:
        try:
            async with asyncio.timeout(_ATTEMPT_S):
                await self.ledger.step_aside(ledger_key, base_id, reader)
        except (RedisError, OSError) as exc:  # it stays counted: the deadline ends it
            log.info("%s: could not count this reader out: %r", base_id, exc)

    async def close(self) -> None:
        if self._leaving:
            await asyncio.wait(set(self._leaving), timeout=_ATTEMPT_S)
        if self._retries is not None:
            self._retries.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retries
        # The cancels still waiting for Redis: one last try, all of them within one
        # attempt's time (one each, in turn, overran the pod's grace with dozens), then
        # those left said, not lost in silence (the engines run that work for nobody).
        left = [cancel for cancel, _ in self._pending.values()]
        self._pending.clear()
        try:
            async with asyncio.timeout(_ATTEMPT_S):
                while left:
                    await self._write(left[0])
                    del left[0]
        except (RedisError, OSError) as exc:
            for cancel in left:
                ids = ", ".join(cancel.request_ids)
                log.warning(
                    "gave up cancelling %s (%s) as the gateway stops: %r", ids, cancel.why, exc
                )

    async def _write(self, cancel: Cancel) -> bool:
        # Both steps may run again (a reply lost): setting a cancel key twice, or
        # releasing a record gone, or a leave of a reader counted out, changes nothing.
        # Counted once, when both ran.
        leaving, key = cancel.if_last_of, cancel.ledger_key
        if (
            leaving is not None
            and key is not None
            and await self.ledger.leave(key, cancel.base_id, leaving) > 0
        ):
            return False  # another attempt still reads it
        await self.broker.cancel(list(cancel.request_ids))
        if cancel.queued is not None:  # after the cancel keys: an engine reading it now drops it
            q = cancel.queued
            await self.broker.withdraw(q.model, q.priority, q.entry_ids)
        if cancel.ledger_key is not None:  # a retry must queue afresh, not attach
            await self.ledger.release(cancel.ledger_key, cancel.base_id)
        self.metrics.cancelled(cancel.why, len(cancel.request_ids))
        return True

    async def _retry(self) -> None:
        pause = _FIRST_RETRY_S
        while self._pending:
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MOST_BETWEEN_S)
            for pending, (cancel, until) in list(self._pending.items()):
                base_id = cancel.base_id
                if time.monotonic() > until:
                    del self._pending[pending]
                    log.warning("gave up cancelling %s: Redis away for too long", base_id)
                    continue
                try:
                    async with asyncio.timeout(_ATTEMPT_S):
                        cancelled = await self._write(cancel)
                except (RedisError, OSError):
                    break  # still away: all of them later
                del self._pending[pending]
                if cancelled:
                    log.info("cancelled %s (%s) once Redis answered", base_id, cancel.why)
                else:
                    log.info("%s (%s): left once Redis answered; another attempt reads it",
                             base_id, cancel.why)  # fmt: skip
                pause = _FIRST_RETRY_S
