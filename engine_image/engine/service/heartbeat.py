"""Heartbeat: renews the engine's registry entry from a thread of its own.

The main loop sends a heartbeat between steps, but one step can outlast the
registry's TTL: a large prefill on a busy CPU takes seconds, and an engine that
vanished from the registry while working is no longer routed to by the gateway
(a model nobody declares and no engine serves is a 404) and is counted as gone
by the autoscaler. So the loop only publishes its latest
EngineInfo here, and this thread re-sends it every `every` seconds, for as long
as the loop is not stalled (a hung loop must drop out, as the liveness probe
would restart it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from tandem.registry_entry import EngineInfo

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        send: Callable[[EngineInfo], object],
        every: float,
        loop_alive: Callable[[], bool],
    ) -> None:
        if not every > 0:
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {every}")
        self._send = send
        self._every = every
        self._loop_alive = loop_alive
        # The loop's latest view; replaced whole, so the thread reads it without a lock.
        self._info: EngineInfo | None = None
        # Whether a beat reached the registry: until then the gateway does not
        # route to this engine, so it must not count as ready.
        self.registered = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def beat(self, info: EngineInfo) -> None:
        """Publish `info` now (from the loop), and keep re-sending it until the next one."""
        self._info = info
        self._send(info)
        self.registered = True

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No beat after this returns (so a deregistration that follows is final)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._every):
            info = self._info
            if info is None or not self._loop_alive():
                continue
            try:
                self._send(info)
                failing = False
            except redis.RedisError as exc:
                # Keep beating. An unreachable Redis is the loop's to report (once);
                # any other failure, once per run of them: not a line every beat.
                unreachable = isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
                level = logging.DEBUG if failing or unreachable else logging.WARNING
                log.log(level, "heartbeat failed: %s", exc)
                failing = True
