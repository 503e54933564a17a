"""GatewaySettings: everything a gateway replica is configured with, checked at start."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from tandem.protocol import check_key_prefix
from tandem.redaction import check_redis_url

# Reads of a response stream block at most this long: redis-py's socket timeout
# is 5 s by default, and a short read lets a replica notice deadlines promptly.
MAX_READ_BLOCK_MS = 1000


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "0.0.0.0"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tandem"
    # YAML or JSON list of keys; TANDEM_API_KEYS adds plain keys (all models).
    api_keys_file: str | None = None
    # Open mode for a trusted network: every caller is "anonymous", no quotas.
    no_auth: bool = False
    # A model whose work streams hold this many waiting entries sheds new requests.
    max_queue: int = 1000
    # Seconds a request may take in all (queueing included); X-Tandem-Timeout lowers it.
    request_timeout: float = 600.0
    max_body_bytes: int = 1 << 20
    # The longest a request's body may take to arrive (408 after it). It is read
    # before the route checks the API key: unbounded, anyone could hold a connection
    # and up to max_body_bytes of memory for as long as they kept it open. (nginx's
    # client_body_timeout is 60 s between two reads; this bounds the whole body.)
    body_timeout_s: float = 60.0
    # The longest a connection may wait to send a request's headers, from its opening
    # or its last response (server.py): idle ones held descriptors for ever.
    header_timeout_s: float = 10.0
    # Chat requests without max_tokens generate at most this many tokens (the
    # engine stops earlier at its context length); completions default to 16 as
    # in the OpenAI API.
    default_max_tokens: int = 1024
    # Most choices one request may ask for (each is its own work item).
    max_n: int = 16
    # Most work items one request may queue: a completions batch's prompts x n (each
    # choice of each prompt is one; held to --max-queue too).
    max_work_items: int = 128
    read_block_ms: int = MAX_READ_BLOCK_MS
    # How long the list of live models is reused before asking the registry again.
    models_cache_s: float = 1.0
    # Every in-flight request holds one connection while it waits for events.
    redis_max_connections: int = 1024
    # Seconds between a replica's beats in Redis, and the silence after which another
    # replica takes it for dead and cancels its work (replicas.py).
    replica_beat_s: float = 5.0
    replica_lapse_s: float = 30.0
    # Completion requests answered at once, past which the replica sheds load (503); None:
    # twice redis_max_connections (load_shedding.py).
    max_answering: int | None = None
    # On SIGTERM, in-flight requests get this long; after that their connections
    # are cut but their queued work is left to the engines (clients may retry
    # with the same Idempotency-Key through another replica and get the answer).
    shutdown_timeout: float = 30.0
    # A model's backlog is read from Redis at most this often (admission.QueueGauge).
    queue_check_interval_s: float = 0.05
    # Retry-After of a 429 for a full queue.
    queue_retry_after_s: int = 1
    access_log: bool = False
    # A request's reads ride out a Redis outage this long (a restart: `tandem up`
    # restarts its Redis within a second or so) before failing with 503.
    redis_outage_s: float = 10.0
    # After Redis restarted (its run_id changed), a request whose work and response
    # stream are both gone is queued again, but only this long after the restart
    # was noticed: an engine still running it writes again within a step or two.
    redis_loss_grace_s: float = 2.0
    # A started stream with nothing to send for this long sends an SSE comment, so that
    # proxies with an idle timeout (often 60 s) do not cut it.
    keepalive_s: float = 15.0
    # /readyz answers 503 when Redis does not answer its PING within this long.
    readyz_timeout_s: float = 1.0
    # Origins whose web pages may call the API from a browser (CORS); "*" any. Empty:
    # none (a browser then refuses the answers to scripts of other origins).
    allowed_origins: tuple[str, ...] = ()

    @property
    def answering_limit(self) -> int:
        """The completion requests answered at once (max_answering, or its default)."""
        if self.max_answering is not None:
            return self.max_answering
        return 2 * self.redis_max_connections

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.redis_url:
            raise ValueError("redis_url must be set (e.g. redis://127.0.0.1:6379/0)")
        check_redis_url(self.redis_url, "--redis-url")
        check_key_prefix(self.key_prefix, "key_prefix")
        if self.no_auth and self.api_keys_file:
            raise ValueError("--no-auth and --api-keys-file contradict each other: choose one")
        _at_least("max_queue", self.max_queue, 0)
        _positive_seconds("request_timeout", self.request_timeout)
        _at_least("max_body_bytes", self.max_body_bytes, 1024)
        _at_least("default_max_tokens", self.default_max_tokens, 1)
        _at_least("max_n", self.max_n, 1)
        _at_least("max_work_items", self.max_work_items, self.max_n)
        _at_least("redis_max_connections", self.redis_max_connections, 2)
        if self.max_answering is not None:
            _at_least("max_answering", self.max_answering, 1)
        _at_least("queue_retry_after_s", self.queue_retry_after_s, 1)
        if not 1 <= self.read_block_ms <= MAX_READ_BLOCK_MS:
            raise ValueError(
                f"read_block_ms must be in 1..{MAX_READ_BLOCK_MS}, got {self.read_block_ms}"
            )
        for name in ("models_cache_s", "queue_check_interval_s", "redis_loss_grace_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value}")
        _positive_seconds("shutdown_timeout", self.shutdown_timeout)
        _positive_seconds("replica_beat_s", self.replica_beat_s)
        if self.replica_lapse_s <= 2 * self.replica_beat_s:
            raise ValueError(
                f"replica_lapse_s ({self.replica_lapse_s}) must be more than twice "
                f"replica_beat_s ({self.replica_beat_s}): one late beat is no dead replica"
            )
        _positive_seconds("redis_outage_s", self.redis_outage_s)
        _positive_seconds("readyz_timeout_s", self.readyz_timeout_s)
        _positive_seconds("keepalive_s", self.keepalive_s)
        _positive_seconds("body_timeout_s", self.body_timeout_s)
        _positive_seconds("header_timeout_s", self.header_timeout_s)
        for origin in self.allowed_origins:
            if origin != "*" and not _is_origin(origin):
                raise ValueError(
                    f"allowed origin {origin!r} is not an origin: give scheme://host[:port] "
                    "(https://chat.example.com) or *"
                )
        # As a browser sends it (compared as a string): https://Chat.Example.com:443
        # passed, and no page of it was ever allowed.
        origins = tuple(o if o == "*" else _as_sent(o) for o in self.allowed_origins)
        object.__setattr__(self, "allowed_origins", origins)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewaySettings:
        return cls(
            host=args.host,
            port=args.port,
            redis_url=args.redis_url,
            key_prefix=args.key_prefix,
            api_keys_file=args.api_keys_file,
            no_auth=args.no_auth,
            max_queue=args.max_queue,
            request_timeout=args.request_timeout,
            max_body_bytes=args.max_body_bytes,
            default_max_tokens=args.default_max_tokens,
            shutdown_timeout=args.shutdown_timeout,
            access_log=args.access_log,
            allowed_origins=tuple(args.allowed_origins or ()),
        )


def _at_least(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _positive_seconds(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _as_sent(origin: str) -> str:
    """An origin as a browser's Origin header says it: scheme and host in lower case,
    no default port."""
    parts = urlsplit(origin)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    default = {"http": 80, "https": 443}[parts.scheme.lower()]
    port = "" if parts.port in (None, default) else f":{parts.port}"
    return f"{parts.scheme.lower()}://{host}{port}"


def _is_origin(value: str) -> bool:
    """scheme://host[:port], nothing after: what a browser sends as Origin."""
    scheme, sep, rest = value.partition("://")
    if not (sep and scheme.lower() in ("http", "https") and rest) or set("/?#@ ") & set(rest):
        return False
    try:
        return urlsplit(value).port is not None or not rest.endswith(":")
    except ValueError:  # a port out of range, or no number
        return False
