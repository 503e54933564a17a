"""A model's backlog in Redis, as its producers and observers see it.

The gateway (and tests) `enqueue` work items; the operator, `tandem up` and the
gateway's admission read the backlog with `queue_depth`; the engines take items
with `tandem.engine.service.work_queue.WorkQueue`, which subtracts what `enqueue`
counted. docs/protocol.md has the keys and the stream layout.

Acked entries are deleted (WorkQueue.ack), so a stream holds only waiting and
pending entries, and on Redis 6.2 (no XINFO lag) `waiting = XLEN - pending`, in O(1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from tandem.keys import Keys
from tandem.protocol import (
    ENQUEUED_TTL_SECONDS,
    HANDOFF_GROUP,
    PRIORITIES,
    WORK_GROUP,
    ProtocolError,
    WorkItem,
    as_text,
)
from tandem.queue_state import QueueState

# The most work entries answers_owed reads of a stream, and how many a read.
_ENDED_SCAN = 1000
_ENDED_PAGE = 100

# The stream field where `enqueue` records the tokens it added to the queued-tokens
# counter: `pull` subtracts exactly that, without parsing the JSON inside Redis (and
# an entry that some other producer added without counting it subtracts nothing).
TOKENS_FIELD = "tokens"


# Queues work items on one stream, each at most once. KEYS: the work stream, the
# model's queued-tokens counter, then each item's `Keys.enqueued` marker. ARGV: the
# markers' TTL, the values per item, then per item its tokens and its field/value
# pairs. Returns each item's entry id.
#
# An item whose marker exists was queued already (a producer whose connection died
# after Redis ran the script runs it again): it gets the entry id it got then,
# counts no tokens and adds no entry. A second entry would be served twice, into
# one response stream. One script: the counter never counts an entry that is not
# in the stream, and the marker never marks one that is not.
ENQUEUE_SCRIPT = """
local ttl, width = ARGV[1], tonumber(ARGV[2])
local ids, total = {}, 0
for n = 3, #KEYS do
  local at = 3 + (n - 3) * width
  local id = redis.call('GET', KEYS[n])
  if not id then
    id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, at + 1, at + width - 1))
    redis.call('SET', KEYS[n], id, 'EX', ttl)
    total = total + tonumber(ARGV[at])
  end
  ids[#ids + 1] = id
end
if total > 0 then redis.call('INCRBY', KEYS[2], total) end
return ids
"""


# Takes back work entries no engine has read yet: those past the group's last-delivered
# id (every one while no engine created the group). KEYS: the work stream, the model's
# queued-tokens counter. ARGV: the group, the tokens field, then the entry ids. Deletes
# each such entry and takes its tokens off the counter; returns how many it deleted. For
# work the gateway cancelled (its client left, its deadline passed): left queued, it
# counted against --max-queue, and the autoscaler's backlog, until an engine had room to
# read and drop it. One read by an engine (pending, or acked and gone) is its engine's.
WITHDRAW_SCRIPT = """
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if not ok then return 0 end
local last = nil
for _, group in ipairs(groups) do
  local info = {}
  for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
  if info['name'] == ARGV[1] then last = info['last-delivered-id'] end
end
local function after(id, mark)
  local a, b = string.match(id, '^(%d+)-(%d+)$')
  local c, d = string.match(mark, '^(%d+)-(%d+)$')
  if not (a and c) then return false end
  a, b, c, d = tonumber(a), tonumber(b), tonumber(c), tonumber(d)
  return a > c or (a == c and b > d)
end
local withdrawn, tokens = 0, 0
for n = 3, #ARGV do
  local id = ARGV[n]
  if last == nil or after(id, last) then
    local entry = redis.call('XRANGE', KEYS[1], id, id)
    if #entry > 0 then
      local fields = entry[1][2]
      for i = 1, #fields, 2 do
        if fields[i] == ARGV[2] then tokens = tokens + tonumber(fields[i + 1]) end
      end
      redis.call('XDEL', KEYS[1], id)
      withdrawn = withdrawn + 1
    end
  end
end
if tokens > 0 then redis.call('DECRBY', KEYS[2], tokens) end
return withdrawn
"""


def withdraw_call(
    keys: Keys, model: str, priority: int, entry_ids: Sequence[str]
) -> tuple[list[str], list[str]]:
    """WITHDRAW_SCRIPT's keys and arguments for entries of one model and priority."""
    stream = keys.work_stream(model, priority)
    return [stream, keys.queued_tokens(model)], [WORK_GROUP, TOKENS_FIELD, *entry_ids]


def withdraw(
    client: redis.Redis, keys: Keys, model: str, priority: int, entry_ids: Sequence[str]
) -> int:
    """Delete the entries no engine has read yet (WITHDRAW_SCRIPT); how many."""
    script_keys, args = withdraw_call(keys, model, priority, entry_ids)
    return int(client.register_script(WITHDRAW_SCRIPT)(keys=script_keys, args=args))


def enqueue_call(keys: Keys, items: Sequence[WorkItem]) -> tuple[list[str], list[Any]]:
    """ENQUEUE_SCRIPT's keys and arguments for items of one model and priority."""
    if not items:
        raise ValueError("nothing to enqueue")
    first = items[0]
    if any((i.model, i.priority) != (first.model, first.priority) for i in items):
        raise ValueError("work items queued together must share model and priority")
    stream = keys.work_stream(first.model, first.priority)  # ValueError on a bad priority
    args: list[Any] = []
    for item in items:
        tokens = item.estimated_prompt_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"estimated_prompt_tokens must be an int >= 0, got {tokens!r}")
        fields = {**item.to_fields(), TOKENS_FIELD: str(tokens)}
        args += [tokens, *(x for pair in fields.items() for x in pair)]
    markers = [keys.enqueued(item.model, item.request_id) for item in items]
    width = len(args) // len(items)
    return [stream, keys.queued_tokens(first.model), *markers], [
        ENQUEUED_TTL_SECONDS,
        width,
        *args,
    ]


def enqueue(client: redis.Redis, keys: Keys, item: WorkItem) -> str:
    """Queue a request on its model's stream of its priority; returns the entry id.
    Queuing a request id again returns its entry and adds nothing (ENQUEUE_SCRIPT)."""
    script_keys, args = enqueue_call(keys, [item])
    (entry_id,) = client.register_script(ENQUEUE_SCRIPT)(keys=script_keys, args=args)
    return as_text(entry_id)


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
    streams = [*keys.work_streams(model), *keys.handoff_streams(model)]
    groups = [WORK_GROUP] * len(PRIORITIES) + [HANDOFF_GROUP] * len(PRIORITIES)
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
    levels = len(PRIORITIES)  # the work streams, then the handoff streams
    return QueueState(
        waiting=dict(zip(PRIORITIES, waiting[:levels], strict=True)),
        pending=sum(pending[:levels]),
        queued_tokens=max(0, int(tokens or 0)),
        handoff_waiting=sum(waiting[levels:]),
        handoff_pending=sum(pending[levels:]),
    )


def answers_owed(client: redis.Redis, keys: Keys, model: str, now: float) -> bool:
    """Whether a request of the model still waits for its answer: an entry an engine
    holds or a handoff, or one queued whose deadline has not passed and that nobody
    cancelled. A queued request past its deadline (the gateway answered 504) or
    cancelled (its client left) waits for an engine only to be acknowledged: `tandem
    up` stops without waiting on it (with its only engine crash-looping, it waited out
    the whole stop timeout for nobody). Past _ENDED_SCAN entries a stream is taken as
    owed (not worth reading whole)."""
    q = queue_depth(client, keys, model)
    if q.pending or q.handoff_waiting or q.handoff_pending:
        return True
    if not q.total_waiting:
        return False
    for stream in keys.work_streams(model):
        start, read = "-", 0
        while read < _ENDED_SCAN:  # a page at a time: a live entry is mostly near the start
            entries = client.xrange(stream, min=start, count=_ENDED_PAGE)
            if not entries:
                break
            try:
                items = [WorkItem.from_fields(fields) for _, fields in entries]
            except ProtocolError:
                return True  # an engine answers it with an error
            live = [i.request_id for i in items if i.deadline is None or i.deadline > now]
            if live and not all(client.mget([keys.cancel_key(rid) for rid in live])):
                return True
            read += len(entries)
            start = "(" + as_text(entries[-1][0])
        else:
            return True  # too long to read whole: taken as owed
    return False
