"""A model's backlog in Redis, as its producers and observers see it.

The gateway (and tests) `enqueue` work items; the operator, `tandem up` and the
gateway's admission read the backlog with `queue_depth`; the engines take items
with `tandem.engine.service.work_queue.WorkQueue`, which subtracts what `enqueue`
counted. docs/protocol.md has the keys and the stream layout.

Acked entries are deleted (WorkQueue.ack), so a stream holds only waiting and
pending entries, and on Redis 6.2 (no XINFO lag) `waiting = XLEN - pending`, in O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from tandem.protocol import HANDOFF_GROUP, PRIORITIES, WORK_GROUP, Keys, WorkItem

# The stream field where `enqueue` records the tokens it added to the queued-tokens
# counter: `pull` subtracts exactly that, without parsing the JSON inside Redis (and
# an entry that some other producer added without counting it subtracts nothing).
TOKENS_FIELD = "tokens"


@dataclass(frozen=True, slots=True)
class QueueState:
    """A model's backlog, for the autoscaler and metrics."""

    # Entries no engine has taken yet, per priority.
    waiting: dict[int, int]
    # Entries taken and not yet acked (being served, or left by a dead engine).
    pending: int
    # Prompt tokens of the waiting entries, as their producers estimated them.
    queued_tokens: int
    # The same two counts for the handoff stream (prefilled, waiting for a decoder).
    handoff_waiting: int
    handoff_pending: int

    @property
    def total_waiting(self) -> int:
        return sum(self.waiting.values())


def enqueue(client: redis.Redis, keys: Keys, item: WorkItem) -> str:
    """Queue a request on its model's stream of its priority; returns the entry id."""
    tokens = item.estimated_prompt_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"estimated_prompt_tokens must be an int >= 0, got {tokens!r}")
    stream = keys.work_stream(item.model, item.priority)  # ValueError on a bad priority
    fields = {**item.to_fields(), TOKENS_FIELD: str(tokens)}
    # MULTI: the counter never counts an entry that is not in the stream.
    pipe = client.pipeline(transaction=True)
    pipe.xadd(stream, fields)
    pipe.incrby(keys.queued_tokens(item.model), tokens)
    entry_id = pipe.execute()[0]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def queue_depth(client: redis.Redis, keys: Keys, model: str) -> QueueState:
    """The backlog of a model, in one round trip.

    waiting = XLEN - pending per stream: exact because acked entries are deleted
    (WorkQueue.ack), and O(1) where counting entries after the group's
    last-delivered-id would be O(backlog). A stream whose group does not exist yet
    (no engine started) has nothing pending.
    """
    # MULTI: one snapshot, so an ack between XLEN and XPENDING cannot skew `waiting`.
    pipe = client.pipeline(transaction=True)
    queue_depth_commands(pipe, keys, model)
    return queue_state(pipe.execute(raise_on_error=False))


def queue_depth_commands(pipe: Any, keys: Keys, model: str) -> None:
    """Queue queue_depth's commands on a pipeline (sync or asyncio: the gateway's too)."""
    streams = [*keys.work_streams(model), keys.handoff_stream(model)]
    groups = [WORK_GROUP] * len(PRIORITIES) + [HANDOFF_GROUP]
    for stream, group in zip(streams, groups, strict=True):
        pipe.xlen(stream)
        pipe.xpending(stream, group)
    pipe.get(keys.queued_tokens(model))


def queue_state(results: list[Any]) -> QueueState:
    """The QueueState of queue_depth_commands' results (executed with raise_on_error=False)."""
    waiting: list[int] = []
    pending: list[int] = []
    for length, summary in zip(results[0:-1:2], results[1:-1:2], strict=True):
        if isinstance(length, Exception):
            raise length
        # No group yet (no engine ever started): nothing is pending.
        if isinstance(summary, Exception) and "NOGROUP" not in str(summary):
            raise summary
        held = 0 if isinstance(summary, Exception) else int(summary["pending"])
        waiting.append(max(0, int(length) - held))
        pending.append(held)
    tokens = results[-1]
    if isinstance(tokens, Exception):
        raise tokens
    return QueueState(
        waiting=dict(zip(PRIORITIES, waiting[:-1], strict=True)),
        pending=sum(pending[:-1]),
        queued_tokens=max(0, int(tokens or 0)),
        handoff_waiting=waiting[-1],
        handoff_pending=pending[-1],
    )
