"""An engine's registry entry: what its heartbeat writes under `{prefix}:engine:{id}` with
a TTL, and what the gateway, the load generator and other engines read back (docs/protocol.md).
A versioned Message of tandem/protocol.py, as the request path's are."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import ClassVar

from tandem.protocol import Message

log = logging.getLogger(__name__)

# A registry entry expires this long after the engine's last heartbeat.
ENGINE_TTL_SECONDS = 10


@dataclass
class EngineInfo(Message):
    """An engine's registry entry, refreshed by its heartbeat."""

    KIND: ClassVar[str] = "engine"

    engine_id: str
    model: str  # the served model name
    role: str  # a Role
    # host:port of its HTTP server (/healthz, /readyz, /metrics).
    http_address: str
    # host:port of its KV server (PROMPT engines), else None.
    kv_address: str | None = None
    started_at: float = field(default_factory=time.time)
    heartbeat_at: float = field(default_factory=time.time)
    draining: bool = False
    # Load at the last heartbeat.
    kv_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    waiting_prompt_tokens: int = 0
    # Its context length: the gateway refuses what can never fit before queueing it.
    # None: an engine from before the field.
    max_model_len: int | None = None
    # It renders a work item's chat options (WorkItem.add_generation_prompt and the
    # rest); False: an engine from before them, which would ignore them.
    chat_options: bool = False
    # A decoder that reads the handoff streams of every priority (handoff:p2, :p0);
    # False: one from before them, which reads the normal one alone.
    priority_handoffs: bool = False


def engine_entry(info: EngineInfo) -> str:
    """What an engine's heartbeat stores under its registry key."""
    return json.dumps(info.to_fields())


def read_engine_entry(engine_id: str, raw: bytes | str) -> EngineInfo | None:
    """An engine's registry entry (its EngineInfo's fields as JSON), or None.

    An entry this side cannot read (another protocol version, a stray key) is
    skipped, not pruned: its engine is alive and may be read by a newer reader.
    """
    try:
        fields = json.loads(raw)
        if not isinstance(fields, dict):
            raise ValueError("not a JSON object")
        return EngineInfo.from_fields(fields)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("skipping unreadable registry entry of engine %r: %s", engine_id, exc)
        return None
