"""Requests Redis lost: found after a restart, and queued again where their clients are.

Redis restarted without its data (`kill -9`, then `tandem up` or Kubernetes
starts it again) loses every queued work entry and response stream. The engines
reconnect and go on with what they hold, but a request still in the queue is
gone: its client would wait for its whole deadline. The gateway still has each
in-flight request's WorkItems, so it queues them again:

- The signal is Redis's `run_id` (INFO server), which every restart changes:
  read at most once a second for all requests (`RedisEpoch`), compared on the
  reader's own wake-ups, so a quiet Redis costs one INFO a second per replica.
  Data lost without a restart (FLUSHALL, a replica's full resync) changes no
  run_id: each request also checks every RECHECK_S that its work is held.
- A restart is not a loss (Redis may have persisted its data, an engine may be
  running the request and writing its stream again), so a request counts as
  lost only when, `redis_loss_grace_s` after the restart was noticed, Redis
  holds neither its work entry, its `enqueued` marker nor its response stream
  (`Broker.held`).
- It is queued again with the same request id, priority and deadline, after a
  response history of the tokens its client was already sent (one event, one
  transaction with the enqueue: `Broker.requeue`). Engines read a request's
  history on every delivery and resume after it (docs/engine-service.md), so a
  stream that had started continues exactly where the client is, sampled or not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from redis.exceptions import RedisError, ResponseError

from tandem.deduplicator import ResponseDeduplicator
from tandem.gateway.broker import Broker
from tandem.gateway.metrics import GatewayMetrics
from tandem.protocol import ResponseEvent, WorkItem

log = logging.getLogger("tandem.gateway")

# The engine_id of the history the gateway writes back (readers show it nowhere).
HISTORY_WRITER = "gateway"
# How often a waiting request checks that Redis still holds its work, restart or not.
RECHECK_S = 10.0
# The most a wake-up waits for Redis's run_id: a paused Redis held it a whole socket
# timeout (5 s), and the deadline or the outage's end with it.
EPOCH_WAIT_S = 1.0


class RedisEpoch:
    """Redis's run_id, read at most every `max_age_s`, one read shared by all requests.

    None when it cannot be read: INFO refused (some managed Redis rename it; then
    lost requests are not found) or Redis unreachable with nothing read before.
    """

    def __init__(self, broker: Broker, max_age_s: float = 1.0) -> None:
        self.broker = broker
        self.max_age_s = max_age_s
        self._run_id: str | None = None
        self._read_at = -float("inf")
        self._read: asyncio.Future[None] | None = None
        self._refused = False

    async def current(self) -> str | None:
        if self._refused or time.monotonic() - self._read_at <= self.max_age_s:
            return self._run_id
        if self._read is None:
            self._read = asyncio.ensure_future(self._refresh())
            self._read.add_done_callback(self._forget)
        await asyncio.shield(self._read)
        return self._run_id

    def _forget(self, _: object) -> None:
        self._read = None

    async def _refresh(self) -> None:
        try:
            self._run_id = await self.broker.run_id()
        except ResponseError as exc:
            self._refused = True
            log.warning("INFO server refused (%s): requests Redis loses are not re-queued", exc)
        except (RedisError, OSError, KeyError):
            pass  # down: the reads fail on their own; keep the last run_id
        self._read_at = time.monotonic()


class LossWatch:
    """One request's work items, queued again if a Redis restart lost them."""

    def __init__(
        self,
        broker: Broker,
        epoch: RedisEpoch,
        items: Sequence[WorkItem],
        entry_ids: Sequence[str | None],
        known: str | None,
        *,
        grace_s: float,
        metrics: GatewayMetrics,
    ) -> None:
        self.broker = broker
        self.epoch = epoch
        self.items = list(items)
        self.entry_ids = list(entry_ids)
        # The run_id as of the enqueue (read before it: a restart in between only
        # makes the first check find the work held).
        self.known = known
        self.grace_s = grace_s
        self.metrics = metrics
        self._noticed_at: float | None = None
        self._checked_at = time.monotonic()  # the last check that Redis holds the work

    async def requeued(
        self, open_choices: Callable[[], Mapping[int, ResponseDeduplicator]]
    ) -> list[int]:
        """Choices (of open_choices(): those still open, with what their client has)
        that Redis lost and that are now queued again; their streams must be read
        from the start. Called on every wake-up of the reader: cheap unless the
        run_id changed."""
        try:
            async with asyncio.timeout(EPOCH_WAIT_S):  # the shared read goes on (shielded)
                run_id = await self.epoch.current()
        except TimeoutError:
            return []  # Redis stalls: the reads find out, and the next wake-up looks again
        now = time.monotonic()
        if run_id is None or run_id == self.known or self.known is None:
            if self.known is None:  # none when queued: INFO had failed; nothing to compare
                self.known = run_id
            # No restart; but a FLUSHALL, or a replica's full resync, loses data too.
            return await self._recheck(open_choices, now)
        if self._noticed_at is None:
            self._noticed_at = now
        if now - self._noticed_at < self.grace_s:
            return []
        still_open = open_choices()
        if not still_open:
            return []
        return await self._requeue_lost(run_id, still_open, sorted(still_open))

    async def _recheck(
        self, open_choices: Callable[[], Mapping[int, ResponseDeduplicator]], now: float
    ) -> list[int]:
        """Every RECHECK_S, whether Redis still holds the work of the choices whose
        entry id is known (an attached request's is not: its marker expires after a
        minute in the queue, and it would look lost)."""
        if now - self._checked_at < RECHECK_S:
            return []
        self._checked_at = now
        still_open = open_choices()
        choices = [i for i in sorted(still_open) if self.entry_ids[i] is not None]
        if not choices:
            return []
        return await self._requeue_lost(self.known, still_open, choices)

    async def _requeue_lost(
        self,
        run_id: str | None,
        still_open: Mapping[int, ResponseDeduplicator],
        choices: list[int],
    ) -> list[int]:
        try:
            held = await self.broker.held(
                [self.items[i] for i in choices], [self.entry_ids[i] for i in choices]
            )
            lost = [i for i, kept in zip(choices, held, strict=True) if not kept]
            if lost:
                histories = [_history(still_open[i]) for i in lost]
                entry_ids = await self.broker.requeue([self.items[i] for i in lost], histories)
                for i, entry_id in zip(lost, entry_ids, strict=True):
                    self.entry_ids[i] = entry_id
        except (RedisError, OSError) as exc:  # Redis went again: next wake-up
            log.warning("could not check that Redis holds %s: %s", self._ids(choices), exc)
            return []
        self.known, self._noticed_at = run_id, None
        if lost:
            log.warning(
                "Redis lost %s (restarted, flushed or resynced): queued again", self._ids(lost)
            )
            self.metrics.requeued(len(lost))
        return lost

    def _ids(self, choices: Sequence[int]) -> str:
        return ", ".join(self.items[i].request_id for i in choices)


def _history(seen: ResponseDeduplicator) -> ResponseEvent | None:
    """What the client of one choice was sent, as one event an engine resumes after."""
    if not seen.token_ids:
        return None
    return ResponseEvent.tokens(0, list(seen.token_ids), seen.text, HISTORY_WRITER)
