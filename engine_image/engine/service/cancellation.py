"""Cancellation: the gateway marks a request cancelled, engines hear of it.

Two channels, because each alone falls short: the cancel key (with a TTL)
answers "was this cancelled?" at any time, e.g. for a request still queued when
the client left; the PUBLISH reaches engines already running the request within
milliseconds, without them polling a key per request per step. Pub/sub drops
messages while a subscriber is disconnected, so after a reconnect the listener
says so (`take_gap`) and the engine re-checks the keys of what it runs
(`cancelled_among`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import redis

from tandem.cancel_notice import cancel_commands
from tandem.keys import Keys
from tandem.protocol import as_text

log = logging.getLogger(__name__)


def cancel(client: redis.Redis, keys: Keys, request_id: str) -> int:
    """Cancel a request; returns how many listeners the notice reached right away."""
    pipe = client.pipeline(transaction=True)
    cancel_commands(pipe, keys, [request_id])
    return int(pipe.execute()[1])


def is_cancelled(client: redis.Redis, keys: Keys, request_id: str) -> bool:
    return bool(client.exists(keys.cancel_key(request_id)))


def cancelled_among(client: redis.Redis, keys: Keys, request_ids: Iterable[str]) -> set[str]:
    """Which of these requests are cancelled, in one round trip (for a batch of new
    work, or for everything running after the listener reported a gap)."""
    ids = list(dict.fromkeys(request_ids))
    if not ids:
        return set()
    values = client.mget([keys.cancel_key(i) for i in ids])
    return {i for i, value in zip(ids, values, strict=True) if value is not None}


class CancelListener:
    """A background thread subscribed to the cancel channel.

    `source` is a Redis URL or a function that returns a new client (called again
    after each connection failure). The thread reconnects with exponential
    backoff until `close()`.
    """

    def __init__(
        self,
        source: str | Callable[[], redis.Redis],
        keys: Keys,
        *,
        poll_s: float = 0.2,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
    ) -> None:
        if poll_s <= 0 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(
                "need poll_s > 0 and 0 < backoff_s <= max_backoff_s, got "
                f"{poll_s}, {backoff_s}, {max_backoff_s}"
            )
        if isinstance(source, str):
            url = source
            # Health checks: a connection that died silently (no RST) is noticed.
            self._factory: Callable[[], redis.Redis] = lambda: redis.Redis.from_url(
                url, health_check_interval=10, socket_connect_timeout=5
            )
        elif callable(source):
            self._factory = source
        else:
            raise ValueError(f"source must be a Redis URL or a client factory, got {source!r}")
        self.keys = keys
        self._poll_s = poll_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        self._gap = False
        self._subscriptions = 0
        self._subscribed = threading.Event()
        self._stop = threading.Event()
        # Daemon: an engine that forgets close() still exits.
        self._thread = threading.Thread(target=self._run, name="cancel-listener", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine side

    def wait_subscribed(self, timeout: float) -> bool:
        """Wait until the subscription is live (notices sent before it are missed)."""
        return self._subscribed.wait(timeout)

    def drain(self) -> set[str]:
        """Request ids cancelled since the last call."""
        with self._lock:
            ids, self._ids = self._ids, set()
        return ids

    def take_gap(self) -> bool:
        """True (once) if the subscription was re-established since the last call:
        notices sent meanwhile are lost, so check running requests with
        `cancelled_among`."""
        with self._lock:
            gap, self._gap = self._gap, False
        return gap

    @property
    def reconnects(self) -> int:
        with self._lock:
            return max(0, self._subscriptions - 1)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> CancelListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        delay = self._backoff_s
        failing = False  # since the last subscription: one line per outage, not per attempt
        while not self._stop.is_set():
            client: redis.Redis | None = None
            pubsub: Any = None
            try:
                client = self._factory()
                pubsub = client.pubsub()
                pubsub.subscribe(self.keys.cancel_channel)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=self._poll_s)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        # Also seen when redis-py reconnects and resubscribes on its
                        # own: counting confirmations catches every gap.
                        self._on_subscribed()
                        delay = self._backoff_s
                        failing = False
                    elif message["type"] == "message":
                        with self._lock:
                            self._ids.add(as_text(message["data"]))
            except Exception as exc:
                # Any failure, not just connection errors: a dead listener thread
                # would leave the engine deaf to cancellations.
                self._subscribed.clear()
                # An unreachable Redis is the engine loop's to report, as a warning.
                unreachable = isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
                level = logging.INFO if unreachable else logging.WARNING
                level = logging.DEBUG if failing else level
                log.log(level, "cancel listener: %s; reconnecting", exc)
                failing = True
                self._stop.wait(delay)
                delay = min(delay * 2, self._max_backoff_s)
            finally:
                _close_quietly(pubsub, client)

    def _on_subscribed(self) -> None:
        with self._lock:
            self._subscriptions += 1
            if self._subscriptions > 1:
                self._gap = True
        self._subscribed.set()


def _close_quietly(*closables: Any) -> None:
    for item in closables:
        if item is None:
            continue
        try:
            item.close()
        except Exception as exc:  # closing a dead connection may fail: nothing to do
            log.debug("cancel listener: close failed: %s", exc)
