"""WorkerSettings: how an engine service behaves, beyond the EngineConfig."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tandem.engine.config import DEFAULT_MIN_BATCHED_TOKENS
from tandem.protocol import Role
from tandem.registry_entry import EngineInfo

# The prompt tokens an engine lets wait in it, in steps of its budget: its next prefill
# steps' worth and no more (what waits in one engine, no other can start). 16k for an
# 8k-context model without chunked prefill (its budget is its context): twice the
# autoscaler's default targetQueuedTokensPerReplica.
WAITING_STEPS = 2


def waiting_tokens(budget: int) -> int:
    """max_waiting_tokens for an engine whose steps take `budget` tokens."""
    return WAITING_STEPS * budget


# The fields check_values() checks, by rule.
_AT_LEAST_ONE = ("claim_idle_ms", "max_deliveries", "max_waiting", "max_waiting_tokens")
_POSITIVE = (
    "handoff_ttl",
    "kv_fetch_timeout",
    "keep_alive_every",
    "heartbeat_every",
    "stall_limit",
)
_SECONDS_OR_ZERO = ("drain_timeout",)
_CHECKED = (*_AT_LEAST_ONE, *_POSITIVE, *_SECONDS_OR_ZERO)


@dataclass(frozen=True)
class WorkerSettings:
    role: Role
    # The served model name: the key of its streams and what clients ask for.
    model_name: str
    # Unique per process; the consumer name in the Redis groups.
    engine_id: str
    # host:port of the /healthz, /readyz, /metrics server.
    http_address: str
    # host:port of the KV server (PROMPT engines), else None.
    kv_address: str | None = None
    # Identifies weights, dtype and KV layout: KV moves only between equal fingerprints.
    fingerprint: str = ""
    # How long a PROMPT engine keeps prefilled KV for a decoder to fetch.
    handoff_ttl: float = 30.0
    # Entries pending this long on a silent consumer are taken over.
    claim_idle_ms: int = 30_000
    # Deliveries after which a request fails instead of being retried again.
    max_deliveries: int = 3
    # How often held entries are marked alive, and the registry refreshed.
    keep_alive_every: float = 5.0
    heartbeat_every: float = 2.0
    # A loop silent this long is hung: the liveness probe fails and heartbeats stop.
    stall_limit: float = 120.0
    # An idle engine waits this long on Redis for work.
    idle_block_ms: int = 50
    # Pull only while fewer requests (and prompt tokens) wait in the engine.
    max_waiting: int = 16
    max_waiting_tokens: int = waiting_tokens(DEFAULT_MIN_BATCHED_TOKENS)
    # SIGTERM: running requests get this long to finish (0: none; others take them over).
    drain_timeout: float = 30.0
    # A KV fetch waiting longer than this (for an answer, then for each read) falls back
    # to recomputing.
    kv_fetch_timeout: float = 10.0
    # The engine ids of this engine's data-parallel group (its own among them), which
    # pull from the same queues; empty alone. Their pulls even out what each holds.
    group: tuple[str, ...] = ()
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))
        check_values({name: getattr(self, name) for name in _CHECKED})
        if self.keep_alive_every * 1000 >= self.claim_idle_ms:
            raise ValueError(
                f"keep_alive_every ({self.keep_alive_every}s) must be well below claim_idle_ms "
                f"({self.claim_idle_ms} ms), or other engines would take over live requests"
            )

    def engine_info(self, *, draining: bool, **load: float | int) -> EngineInfo:
        return EngineInfo(
            engine_id=self.engine_id,
            model=self.model_name,
            role=str(self.role),
            http_address=self.http_address,
            kv_address=self.kv_address,
            started_at=self.started_at,
            draining=draining,
            chat_options=True,
            priority_handoffs=True,
            **load,
        )


def check_values(values: Mapping[str, float], name: Callable[[str], str] = str) -> None:
    """ValueError, naming name(field), for the first value its WorkerSettings field refuses.

    `values` maps field names to values; only those are checked. WorkerSettings checks
    all of its own; `tandem engine` checks those its flags set before the model loads
    (arguments.py), naming the flags.
    """
    for field_name, value in values.items():
        if field_name in _AT_LEAST_ONE and not value >= 1:
            raise ValueError(f"{name(field_name)} must be at least 1, got {value}")
        if field_name in _POSITIVE and not 0 < value < math.inf:  # NaN too
            raise ValueError(f"{name(field_name)} must be a finite number > 0, got {value}")
        if field_name in _SECONDS_OR_ZERO and not value >= 0:  # NaN too
            raise ValueError(f"{name(field_name)} must be 0 or more seconds, got {value}")
