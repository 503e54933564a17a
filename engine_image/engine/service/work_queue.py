"""The engine's side of the work queue: Redis streams read through a consumer group.

NORMAL and PROMPT engines take WorkItems from the model's work streams (one per
priority, group WORK_GROUP); COMPLETION engines take Handoffs from the handoff
stream (group HANDOFF_GROUP). One `pull` is one Lua script, so one round trip:

1. reclaim entries that stayed pending longer than `claim_idle_ms` (their engine
   died), highest priority first, counting each delivery;
2. read new entries (">"), highest priority first, never more than `max_items`;
3. lower the model's queued-tokens counter by what the new entries carried.

The script runs atomically, so two engines never claim the same idle entry and
the delivery counts it reports are exact.

Acked entries are deleted (XACK + XDEL in one MULTI) instead of trimming the
stream with MAXLEN on the producer side: MAXLEN would silently drop queued
requests whenever the backlog outgrows the cap, and a backlog is exactly what
the autoscaler is meant to see. With every acked entry deleted, a stream holds
only waiting and pending entries, so on Redis 6.2 (no XINFO lag)
`waiting = XLEN - pending`, in O(1) (see `tandem.backlog.queue_depth`, with the
producer side, `enqueue`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from tandem.backlog import TOKENS_FIELD
from tandem.protocol import (
    HANDOFF_GROUP,
    WORK_GROUP,
    Handoff,
    Keys,
    ProtocolError,
    Role,
    WorkItem,
    as_text,
)

# KEYS: the streams, highest priority first, then (when ARGV[6] == "1") the
# queued-tokens counter. ARGV: group, consumer, max_items, claim_idle_ms,
# max_deliveries, has_counter, tokens field.
# Returns {entries, lost, newest}: entries as {stream index, id, fields, times
# delivered, reclaimed}; lost: {stream index, id} of entries deleted while still
# pending (Redis 6.2 keeps them in the PEL and XCLAIM answers nil: acked here so
# they do not come back forever); newest: the newest id of each stream, only
# when nothing was found, for the blocking wake-up read.
_PULL_LUA = """
local group, consumer, idle = ARGV[1], ARGV[2], tonumber(ARGV[4])
local room, max_deliveries = tonumber(ARGV[3]), tonumber(ARGV[5])
local nstreams = #KEYS
local counter = nil
if ARGV[6] == '1' then
  counter = KEYS[#KEYS]
  nstreams = nstreams - 1
end
local tokens_field = ARGV[7]
local entries, lost = {}, {}

for i = 1, nstreams do
  if room <= 0 then break end
  local idle_entries = redis.call('XPENDING', KEYS[i], group, 'IDLE', idle, '-', '+', room)
  for _, p in ipairs(idle_entries) do
    local claimed = redis.call('XCLAIM', KEYS[i], group, consumer, idle, p[1])
    local entry = claimed[1]
    if entry then
      local times = p[4] + 1
      entries[#entries + 1] = {i, entry[1], entry[2], times, 1}
      -- Exhausted entries are reported, not worked on: they take no room.
      if times <= max_deliveries then room = room - 1 end
    else
      redis.call('XACK', KEYS[i], group, p[1])
      lost[#lost + 1] = {i, p[1]}
    end
  end
end

local tokens = 0
for i = 1, nstreams do
  if room <= 0 then break end
  local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', room,
                         'STREAMS', KEYS[i], '>')
  if got then
    for _, entry in ipairs(got[1][2]) do
      entries[#entries + 1] = {i, entry[1], entry[2], 1, 0}
      room = room - 1
      local f = entry[2]
      for j = 1, #f, 2 do
        local n = f[j] == tokens_field and tonumber(f[j + 1])
        if n and n > 0 then tokens = tokens + math.floor(n) end
      end
    end
  end
end
if counter and tokens > 0 then
  if redis.call('DECRBY', counter, tokens) < 0 then redis.call('SET', counter, 0) end
end

local newest = {}
if #entries == 0 and #lost == 0 then
  for i = 1, nstreams do
    local last = redis.call('XREVRANGE', KEYS[i], '+', '-', 'COUNT', 1)
    newest[i] = last[1] and last[1][1] or '0-0'
  end
end
return {entries, lost, newest}
"""

# Refresh the idle time of entries this consumer still owns. An entry another
# consumer reclaimed meanwhile is left alone (XCLAIM with min-idle 0 would steal
# it back and both engines would serve it) and reported as lost. Without the
# group (Redis lost its data) nobody else can take the entries: none is lost.
# KEYS[1]: stream. ARGV: group, consumer, ids...
_KEEP_ALIVE_LUA = """
local lost = {}
if redis.pcall('XPENDING', KEYS[1], ARGV[1]).err then return lost end
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One stream entry handed to this engine."""

    stream: str
    entry_id: str
    message: WorkItem | Handoff
    # 1 for a new entry; more when it was reclaimed from a consumer that died.
    times_delivered: int
    reclaimed: bool
    # Delivered more than max_deliveries times: answer with an error, do not run.
    exhausted: bool = False

    @property
    def request_id(self) -> str:
        if isinstance(self.message, Handoff):
            return self.message.work["request_id"]
        return self.message.request_id


@dataclass(slots=True)
class Pulled:
    """What one `pull` took. `work` is to run; the rest needs only an answer.

    exhausted: delivered more than max_deliveries times (engines kept dying on
    them): write an ErrorCode.REDELIVERY_LIMIT event, then `ack` them.
    malformed: (entry_id, why) of entries that cannot be read; already acked.
    Iterating yields work, then exhausted deliveries (`Delivery.exhausted` tells
    them apart), for a loop that handles both in one place.
    """

    work: list[Delivery] = field(default_factory=list)
    exhausted: list[Delivery] = field(default_factory=list)
    malformed: list[tuple[str, str]] = field(default_factory=list)

    def __iter__(self) -> Iterator[Delivery]:
        yield from self.work
        yield from self.exhausted

    def __len__(self) -> int:
        return len(self.work) + len(self.exhausted)

    def __bool__(self) -> bool:
        """True when anything was taken, malformed entries included."""
        return bool(self.work or self.exhausted or self.malformed)


class WorkQueue:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        model: str,
        role: Role | str,
        consumer: str,
        *,
        claim_idle_ms: int = 30_000,
        max_deliveries: int = 3,
    ) -> None:
        if not model:
            raise ValueError("model must be a non-empty name")
        if not consumer:
            raise ValueError("consumer must be a non-empty name (the engine id)")
        if claim_idle_ms < 1:
            raise ValueError(f"claim_idle_ms must be at least 1, got {claim_idle_ms}")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be at least 1, got {max_deliveries}")
        self.role = Role(role)
        self.client = client
        self.keys = keys
        self.model = model
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        if self.role is Role.COMPLETION:
            self.group = HANDOFF_GROUP
            self.streams = [keys.handoff_stream(model)]
            self._counter: str | None = None
        else:
            self.group = WORK_GROUP
            self.streams = keys.work_streams(model)
            self._counter = keys.queued_tokens(model)
        self._pull_script = client.register_script(_PULL_LUA)
        self._keep_alive_script = client.register_script(_KEEP_ALIVE_LUA)
        self.ensure_groups()

    def ensure_groups(self) -> None:
        """Create the consumer groups (and streams) if missing.

        From id 0, so requests queued before the first engine started are served.
        """
        pipe = self.client.pipeline(transaction=False)
        for stream in self.streams:
            pipe.xgroup_create(stream, self.group, id="0", mkstream=True)
        for result in pipe.execute(raise_on_error=False):
            if isinstance(result, Exception) and "BUSYGROUP" not in str(result):
                raise result

    # ------------------------------------------------------------------ take

    def pull(self, max_items: int, block_ms: int = 0) -> Pulled:
        """Take at most `max_items` entries to work on: reclaimed first, then new ones.

        Blocks up to `block_ms` only when there was nothing at all; the client's
        socket_timeout must then be longer than block_ms.
        """
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        if block_ms < 0:
            raise ValueError(f"block_ms must be >= 0, got {block_ms}")
        entries, lost, newest = self._run_pull(max_items)
        if not entries and not lost and block_ms > 0:
            # Wake up on any new entry without taking it: a blocking XREADGROUP over
            # several streams could return more than max_items and ignore priority.
            # A wake-up for an entry another engine takes first just finds nothing.
            self.client.xread(dict(zip(self.streams, newest, strict=True)), count=1, block=block_ms)
            entries, lost, newest = self._run_pull(max_items)
        return self._sort(entries, lost)

    def _run_pull(self, max_items: int) -> tuple[list[Any], list[Any], list[Any]]:
        keys = [*self.streams, *([self._counter] if self._counter else [])]
        has_counter = "1" if self._counter else "0"
        args = [self.group, self.consumer, max_items, self.claim_idle_ms, self.max_deliveries]
        args += [has_counter, TOKENS_FIELD]
        try:
            entries, lost, newest = self._pull_script(keys=keys, args=args)
        except redis.ResponseError as exc:
            # The streams vanished (Redis restarted without persistence, or a
            # FLUSHALL): recreate the groups and go on instead of failing every step.
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_groups()
            entries, lost, newest = self._pull_script(keys=keys, args=args)
        return entries, lost, [as_text(x) for x in newest]

    def _sort(self, entries: list[Any], lost: list[Any]) -> Pulled:
        pulled = Pulled()
        unreadable: list[tuple[str, str]] = []
        for index, raw_id, flat, times, reclaimed in entries:
            stream, entry_id = self.streams[index - 1], as_text(raw_id)
            fields = {as_text(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
            try:
                message = self._decode(fields)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                # ProtocolError is a ValueError; the others come from JSON that is
                # valid but not an object of the expected shape.
                pulled.malformed.append((entry_id, f"{stream} {entry_id}: {exc}"))
                unreadable.append((stream, entry_id))
                continue
            exhausted = int(times) > self.max_deliveries
            delivery = Delivery(stream, entry_id, message, int(times), bool(reclaimed), exhausted)
            (pulled.exhausted if exhausted else pulled.work).append(delivery)
        for index, raw_id in lost:
            entry_id = as_text(raw_id)
            stream = self.streams[index - 1]
            pulled.malformed.append((entry_id, f"{stream} {entry_id}: deleted while pending"))
        if unreadable:
            self._ack_ids(unreadable)
        return pulled

    def _decode(self, fields: dict[str, Any]) -> WorkItem | Handoff:
        if self.role is Role.COMPLETION:
            handoff = Handoff.from_fields(fields)
            # Decode the inner WorkItem now: a bad one is malformed, not a mid-step crash.
            if not handoff.work_item.request_id:
                raise ProtocolError("handoff of a work item without request_id")
            return handoff
        return WorkItem.from_fields(fields)

    # ------------------------------------------------------------ bookkeeping

    def ack(self, deliveries: Iterable[Delivery]) -> int:
        """Acknowledge and delete finished entries; returns how many were pending."""
        return self._ack_ids([(d.stream, d.entry_id) for d in deliveries])

    def _ack_ids(self, ids: Sequence[tuple[str, str]]) -> int:
        if not ids:
            return 0
        by_stream: dict[str, list[str]] = defaultdict(list)
        for stream, entry_id in ids:
            by_stream[stream].append(entry_id)
        # MULTI: an entry is never deleted without its ack (a deleted entry left in
        # the PEL would be counted as pending forever).
        pipe = self.client.pipeline(transaction=True)
        for stream, entry_ids in by_stream.items():
            pipe.xack(stream, self.group, *entry_ids)
            pipe.xdel(stream, *entry_ids)
        return sum(pipe.execute()[0::2])

    def keep_alive(self, deliveries: Iterable[Delivery]) -> list[Delivery]:
        """Reset the idle time of entries still in work, so no engine reclaims them.

        Call every few seconds (well under claim_idle_ms) for every entry still held.
        Returns the deliveries this engine no longer owns (another engine reclaimed
        them after a long stall, or they were acked): stop serving those.
        """
        by_stream: dict[str, dict[str, Delivery]] = defaultdict(dict)
        for d in deliveries:
            by_stream[d.stream][d.entry_id] = d
        if not by_stream:
            return []
        pipe = self.client.pipeline(transaction=False)
        for stream, held in by_stream.items():
            self._keep_alive_script(
                keys=[stream], args=[self.group, self.consumer, *held], client=pipe
            )
        lost: list[Delivery] = []
        for held, lost_ids in zip(by_stream.values(), pipe.execute(), strict=True):
            lost.extend(held[as_text(x)] for x in lost_ids)
        return lost

    def publish_handoff(self, handoff: Handoff) -> str:
        """Offer a prefilled request to the model's COMPLETION engines."""
        return as_text(self.client.xadd(self.keys.handoff_stream(self.model), handoff.to_fields()))
