"""Held: what an engine keeps of a request it works on, beside the engine's own state."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.service.work_queue import Delivery
from tandem.protocol import ErrorCode, WorkItem


@dataclass
class Held:
    """A request this engine works on, and the Redis entry that stays pending meanwhile."""

    delivery: Delivery
    work: WorkItem
    # Output tokens the client already has (resumed or sent by a PROMPT engine).
    sent: int = 0
    # Output tokens in its response stream once this engine's events are written: an
    # ending's offset (protocol.md: the tokens sent before it).
    written: int = 0
    first_token_at: float | None = None
    cached_tokens: int = 0
    # Set when a cancellation or deadline arrives while the KV is still being fetched.
    end_with: tuple[ErrorCode, str] | None = field(default=None)
    # Set when another engine took the request over while its KV was being fetched:
    # forgotten as the fetch ends, before it can run (and write into the other's stream).
    dropped: bool = False
    # False once its entry is pending nowhere and no engine finished it (Redis lost
    # it): served to the end, with nothing to keep alive, unless queued again.
    pending: bool = True
