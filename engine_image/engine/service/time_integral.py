"""A running integral over time of a value that changes in steps.

It is the total behind a `*_seconds_total` counter: the counter's rate over
any interval is the value's mean over that interval. The engine's waiting
prompt tokens swing between empty and full around each prompt step, so a
gauge scraped every 15 s reads anywhere on that swing; the rate of its
integral is the interval's true mean (docs/autoscaling.md).
"""

from __future__ import annotations

import threading


class TimeIntegral:
    """The integral of a piecewise-constant value, read at any time.

    `set` is called by the thread that changes the value, `total` by the one
    that serves /metrics. Each call first adds the span since the last one at
    the current value, and no call adds a span before one already added: a
    reading is history. So the total never goes down (a Prometheus counter
    that did would read as an engine restart), even when a reader's clock
    reading is newer than the writer's next one. Times are seconds on one
    monotonic clock.
    """

    def __init__(self, now: float, value: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._value = value
        self._since = now  # the total holds the integral up to here
        self._total = 0.0

    def set(self, value: float, now: float) -> None:
        """The value is `value` from `now` on (or from the last reading, if that is later)."""
        with self._lock:
            self._advance(now)
            self._value = value

    def total(self, now: float) -> float:
        """The integral up to `now` (or up to the last reading, if that is later)."""
        with self._lock:
            self._advance(now)
            return self._total

    def _advance(self, now: float) -> None:
        if now > self._since:
            self._total += self._value * (now - self._since)
            self._since = now
