"""What an engine's /healthz and /readyz answer, from its worker's state.

Pure functions of the worker (None while the model loads) and the time, so the
rules are tested without a process: live while the loop turns; ready while it is
registered, not draining, its loop turning and Redis reachable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.engine.service.worker import EngineWorker

Answer = tuple[bool, str]


def live(worker: EngineWorker | None, now: float | None = None) -> Answer:
    """Whether the loop turned within the stall limit (a rank waiting on a hung peer
    at the group's vote does not)."""
    if worker is None:
        return True, "starting"
    stalled = (time.monotonic() if now is None else now) - worker.last_loop_at
    return stalled < worker.settings.stall_limit, f"last loop {stalled:.1f}s ago"


def ready(
    worker: EngineWorker | None, ping: Callable[[], bool], now: float | None = None
) -> Answer:
    """Whether the gateway routes to it and it can serve what it takes."""
    if worker is None or worker.draining:
        return False, "draining" if worker else "starting"
    if not worker.heartbeat.registered:  # the gateway would answer 404 for it
        return False, "not yet in the registry"
    looping, why = live(worker, now)
    if not looping:  # its heartbeat stopped with it: out of the registry soon
        return False, f"the loop is stalled ({why})"
    if worker.outage.down:  # known without asking: answer at once
        return False, f"redis unreachable for {worker.outage.seconds():.0f}s"
    reachable = ping()
    return reachable, "model loaded, redis reachable" if reachable else "redis unreachable"
