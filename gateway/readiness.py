"""ReadinessLog: the gateway's log says when its readiness changes, and why.

Kubelet's events show a failed readiness probe's status, not its body, and a pod
never ready gets no request whose error would be logged: a gateway refused by
Redis (a password Secret ending in a newline) was unready for ever with nothing in
its log but uvicorn's start.
"""

from __future__ import annotations

import logging

from tandem.redaction import redacted

log = logging.getLogger("tandem.gateway")


class ReadinessLog:
    def __init__(self, redis_url: str) -> None:
        self._redis_url = redis_url
        self._problem: str | None = None  # why the last probe was unready; None: ready

    def saw(self, problem: str | None) -> None:
        """One probe's finding: None (ready), or why not. Logged when it changes."""
        if problem == self._problem:
            return
        if problem is None:
            log.info("ready again: Redis answers")
        else:
            log.warning("not ready: %s (Redis at %s)", problem, redacted(self._redis_url))
        self._problem = problem
