"""QueueState: a model's backlog in Redis, as numbers (no Redis client here).

tandem.backlog reads it from Redis (queue_depth), the gateway's broker from
redis.asyncio, and the simulator makes it from its own queues; the autoscaler
(tandem.operator.autoscaler) reads it, and stays free of any I/O module.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueState:
    """A model's backlog, for the autoscaler and metrics."""

    # Entries no engine has taken yet, per priority.
    waiting: dict[int, int]
    # Entries taken and not yet acked (being served, or left by a dead engine).
    pending: int
    # Prompt tokens of the waiting entries, as their producers estimated them.
    queued_tokens: int
    # The same two counts for the handoff streams (prefilled, waiting for a decoder).
    handoff_waiting: int
    handoff_pending: int

    @property
    def total_waiting(self) -> int:
        return sum(self.waiting.values())
