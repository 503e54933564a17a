"""RedisOutage: the loop's view of whether Redis answers, and when to try it again.

A Redis that stops answering (paused, restarting, a network cut) must not end the
engine: its running requests, their KV and the output not yet written are worth
keeping, and no other engine can take them over while Redis is away anyway. So
the loop goes on stepping, keeps its events in order, takes no new work, and
writes again once Redis is back (docs/engine-service.md, "Losing Redis").

Whether it is back, a thread finds out: it PINGs, with backoff, on a client with
a short timeout. The loop itself never waits on an absent Redis but once, when
a command first fails (a paused Redis holds each command for the whole socket
timeout), so its steps go on at full speed. One WARNING when Redis goes, one
INFO when it is back: not a line per attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from tandem.redis_refusal import refusal

log = logging.getLogger(__name__)

# What "Redis is away" looks like: connection refused or cut, no answer in time.
# BusyLoadingError (a restarted Redis still loading its append-only file) is a
# ConnectionError.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError)


def unavailable(exc: BaseException) -> bool:
    """Whether a Redis error means "not now" (wait and retry, keeping everything):
    unreachable, or refusing writes for a while (tandem.redis_refusal). Any other is
    a bug or a bad command, and still ends the engine."""
    return isinstance(exc, UNREACHABLE) or refusal(exc) is not None


class RedisOutage:
    def __init__(
        self,
        probe: Callable[[], bool],
        *,
        first_retry_s: float = 0.1,
        max_retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """probe(): whether Redis takes a write now (quickly, either way)."""
        if not 0 < first_retry_s <= max_retry_s:
            raise ValueError(
                f"need 0 < first_retry_s <= max_retry_s, got {first_retry_s}, {max_retry_s}"
            )
        self._probe = probe
        self._first, self._max = first_retry_s, max_retry_s
        self._clock = clock
        self.since: float | None = None  # clock() when Redis went away; None while it answers
        self._answers = threading.Event()  # set by the watcher once a PING went through
        self._watcher: threading.Thread | None = None

    @property
    def down(self) -> bool:
        return self.since is not None

    def seconds(self) -> float:
        """How long Redis has been away (0 while it answers)."""
        return 0.0 if self.since is None else self._clock() - self.since

    def failed(self, exc: Exception, holding: str) -> None:
        """A command failed, `unavailable(exc)`: wait for Redis (and say so, once)."""
        if self.since is None:
            self.since = self._clock()
            log.warning(
                "Redis unavailable (%s: %s): %s; taking no new work, retrying",
                type(exc).__name__,
                exc,
                holding,
            )
        # A watcher that saw Redis answer is done, though it may not have exited yet:
        # left to it, this failure would wait for a PING nobody sends (for good).
        done = self._answers.is_set()
        self._answers.clear()
        if done or self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(target=self._watch, name="redis-watch", daemon=True)
            self._watcher.start()

    def may_try(self) -> bool:
        """Whether to send Redis commands now: while up, always; while down, once a
        PING went through since the last failure."""
        return self.since is None or self._answers.is_set()

    def recovered(self, done: str) -> None:
        """The loop's commands went through again (log it, if Redis had been away)."""
        if self.since is not None:
            log.info("Redis reachable again after %.1f s: %s", self.seconds(), done)
            self.since = None

    def _watch(self) -> None:
        wait = self._first
        while not self._probe():
            time.sleep(wait)
            wait = min(wait * 2, self._max)
        self._answers.set()
