"""Idempotency-Key: a retried request finds the work its first attempt queued.

A client whose connection died with a gateway replica (crashed, restarted)
cannot know whether its request was queued. Retried with the same
`Idempotency-Key` header through any replica, the request attaches to the
first attempt's work items and reads their response streams from the start,
instead of queueing the work twice: the first attempt's queued work is never
lost, and never served twice. The record lives in Redis under the caller's
name, so two API keys never share one.

Beside the record, a count of the attempts reading the work: a client that
leaves (or whose deadline passes) cancels the work only if it was the last
reader (cancels.py). The record is dropped when the gateway cancels the work,
so a later retry queues afresh rather than attaching to a cancelled request.

The record is claimed before the work is queued (the queue's room and the quota
come between) and marked queued after: a retry that finds it not yet queued
waits for the mark, or for the record to go (the first attempt refused: it
queues afresh), rather than read streams no engine will ever write. A record
still unqueued after PENDING_WAIT_S is a first attempt that died between the
two: the retry takes it over.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, replace

import redis.asyncio as aioredis

from tandem.gateway.errors import NO_RETRY, GatewayError, bad_request
from tandem.protocol import RESPONSE_TTL_SECONDS

_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
# How long a retry waits for the first attempt's work to be queued (milliseconds
# apart, unless Redis stalls), and how often it looks.
PENDING_WAIT_S = 5.0
_PENDING_POLL_S = 0.05
_CLAIMS = 20
# A record outlives no response stream it points to: its TTL once the answer is whole
# is the streams' (from their last event, moments before) less this.
_STREAM_MARGIN_S = 30

# What the scripts below that act on one attempt's record begin with: the record
# (KEYS[1]) as it is now, and whether it is still that attempt's (ARGV[1]).
_OWNED_LUA = """
local raw = redis.call('GET', KEYS[1])
local owned = raw and cjson.decode(raw)['base_id'] == ARGV[1]
"""

# Delete the record and its readers (KEYS[2], KEYS[3]) only if it is still the one
# this attempt wrote.
_RELEASE_LUA = (
    _OWNED_LUA
    + """
if owned then return redis.call('DEL', KEYS[1], KEYS[2], KEYS[3]) end
return 0
"""
)

# The record (if still ARGV[1]'s) and its readers expire within ARGV[2] s, never later
# than they would have (EXPIRE's LT option, before Redis 7).
_ANSWERED_LUA = (
    _OWNED_LUA
    + """
if not owned then return 0 end
local ttl = tonumber(ARGV[2])
for _, key in ipairs(KEYS) do
  if redis.call('TTL', key) > ttl then redis.call('EXPIRE', key, ttl) end
end
return 1
"""
)

# Replace the record by ARGV[2] (the same, marked queued) only if it is still this
# attempt's (ARGV[1]), keeping its TTL.
_QUEUED_LUA = (
    _OWNED_LUA
    + """
if owned then return redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') end
return false
"""
)


# The readers of a record's work are counted twice over. KEYS[2], the count every
# gateway version reads and moves: a reader more or less, INCR / DECR. KEYS[3], the
# set of the readers' attempt ids, which moves the count only when it changes itself:
# a leave sent twice (its reply lost in a Redis pause, sent again with the cancel that
# waited for it) counts its attempt out once, where a count alone went down twice and
# took the work from a reader still there. (Gateways from before the set move the
# count alone; both kinds read it, so a rolling upgrade keeps one tally.)

# Write the record and its readers (this attempt, ARGV[2]) if the key is new, in one
# step: written apart, a retry attaching between them had its count overwritten, and
# the first attempt's leaving then cancelled the work the retry still read. Run again
# after a lost reply, it finds its own record (ARGV[2]) and queues nothing twice.
# Returns nil to go ahead and queue, else the record found.
_CLAIM_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) then
  redis.call('SET', KEYS[2], 1, 'EX', ARGV[3])
  redis.call('DEL', KEYS[3])
  redis.call('SADD', KEYS[3], ARGV[2])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  return false
end
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['base_id'] == ARGV[2] then
  redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[3])
  if redis.call('SADD', KEYS[3], ARGV[2]) == 1 then redis.call('EXPIRE', KEYS[3], ARGV[3]) end
  return false
end
return raw
"""

# One more reader (ARGV[3]) of the first attempt's work, only while its record is
# there: read apart, the record could be released (its last reader gone, the work
# cancelled) between the look and the count, and the retry attached to cancelled work.
# Returns how many read it; 0: gone.
_ATTACH_LUA = (
    _OWNED_LUA
    + """
if not owned then return 0 end
if redis.call('SADD', KEYS[3], ARGV[3]) == 1 then redis.call('INCR', KEYS[2]) end
-- Never shorter than it was: a first attempt with a longer deadline still reads.
for i = 2, 3 do
  if redis.call('TTL', KEYS[i]) < tonumber(ARGV[2]) then redis.call('EXPIRE', KEYS[i], ARGV[2]) end
end
return tonumber(redis.call('GET', KEYS[2]))
"""
)

# One attempt (ARGV[2]) stops reading: with none left, the record goes in the same
# step, so that no retry attaches to work about to be cancelled (it queues afresh
# instead). Returns how many still read it.
_LEAVE_LUA = """
if redis.call('SREM', KEYS[3], ARGV[2]) == 1 then redis.call('DECR', KEYS[2]) end
local left = tonumber(redis.call('GET', KEYS[2]) or '0')
if left <= 0 then
  redis.call('DEL', KEYS[2], KEYS[3])
  local raw = redis.call('GET', KEYS[1])
  if raw and cjson.decode(raw)['base_id'] == ARGV[1] then redis.call('DEL', KEYS[1]) end
end
return left
"""


# A reader (ARGV[1]) leaves without ending the work: the record stays for a retry to
# attach to.
_STEP_ASIDE_LUA = """
if redis.call('SREM', KEYS[2], ARGV[1]) == 1 then redis.call('DECR', KEYS[1]) end
local left = tonumber(redis.call('GET', KEYS[1]) or '0')
if left <= 0 then redis.call('DEL', KEYS[1], KEYS[2]) end
return left
"""


@dataclass(frozen=True)
class IdempotencyRecord:
    base_id: str
    request_ids: list[str]
    created: int
    digest: str
    # False from the claim until the work is queued (a record without the field, from
    # an older gateway, was written once queued).
    queued: bool = True


class IdempotencyLedger:
    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._release = client.register_script(_RELEASE_LUA)
        self._leave = client.register_script(_LEAVE_LUA)
        self._step_aside = client.register_script(_STEP_ASIDE_LUA)
        self._claim = client.register_script(_CLAIM_LUA)
        self._attach = client.register_script(_ATTACH_LUA)
        self._queued = client.register_script(_QUEUED_LUA)
        self._answered = client.register_script(_ANSWERED_LUA)

    def key(self, caller: str, idempotency_key: str) -> str:
        if not _KEY.match(idempotency_key):
            raise bad_request(
                "Idempotency-Key must be 1-255 printable ASCII characters without spaces",
                "Idempotency-Key",
            )
        digest = hashlib.sha256(f"{caller}\0{idempotency_key}".encode()).hexdigest()
        # A hash tag: the record and its readers' count share a Redis Cluster slot.
        return f"{self.prefix}:idem:{{{digest}}}"

    async def claim(
        self, key: str, record: IdempotencyRecord, timeout: float
    ) -> IdempotencyRecord | None:
        """Write the record if the key is new (None: go ahead and queue), else
        return the first attempt's record, to attach to. A record for other
        content is a 409: the key was reused for a different request."""
        # It must outlive the work: the deadline, then the response stream's TTL.
        ttl = int(timeout) + RESPONSE_TTL_SECONDS
        payload = json.dumps(asdict(replace(record, queued=False)))
        own = [key, *self._readers(key, record.base_id)]
        # A record gone between the claim and the attach (released: its attempt refused,
        # or its last reader left): claim again. Several retries racing a refusal each
        # see it go once.
        for _ in range(_CLAIMS):
            raw = await self._claim(keys=own, args=[payload, record.base_id, ttl])
            if raw is None:
                return None
            first = IdempotencyRecord(**json.loads(raw))
            if first.digest == record.digest and not first.queued:  # a 409 waits for nothing
                first = await self._until_queued(key, first)
                if first is None:
                    continue  # refused, or dead before it queued: claim it afresh
            if first.digest != record.digest:
                raise GatewayError(
                    409,
                    "Idempotency-Key was already used for a different request",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                    reason="idempotency_conflict",
                    headers=NO_RETRY,  # the same request would be refused again
                )
            readers = self._readers(key, first.base_id)
            if await self._attach(keys=[key, *readers], args=[first.base_id, ttl, record.base_id]):
                return first
        raise GatewayError(503, "could not record the Idempotency-Key", type="server_error")

    async def queued(self, key: str, record: IdempotencyRecord) -> None:
        """Mark the record's work queued: retries waiting for it attach now."""
        payload = json.dumps(asdict(replace(record, queued=True)))
        await self._queued(keys=[key], args=[record.base_id, payload])

    async def _until_queued(self, key: str, first: IdempotencyRecord) -> IdempotencyRecord | None:
        """The first attempt's record once its work is queued; None once it is gone
        (refused, nothing queued) or, still unqueued after PENDING_WAIT_S, taken
        over (its attempt died between the claim and the queueing)."""
        deadline = time.monotonic() + PENDING_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(_PENDING_POLL_S)
            raw = await self.client.get(key)
            if raw is None:
                return None
            now = IdempotencyRecord(**json.loads(raw))
            if now.base_id != first.base_id:
                return None  # another attempt's record now: claim again to find it
            if now.queued:
                return now
        await self.release(key, first.base_id)
        return None

    async def answered(self, key: str, base_id: str) -> None:
        """The work's answer is whole: its response streams last RESPONSE_TTL_SECONDS
        from their last event, now. The record and its readers' count no longer than
        that: past it, a retry attached to streams gone and waited for its deadline."""
        ttl = RESPONSE_TTL_SECONDS - _STREAM_MARGIN_S
        await self._answered(keys=[key, *self._readers(key, base_id)], args=[base_id, ttl])

    async def leave(self, key: str, base_id: str, reader: str) -> int:
        """Attempt `reader` stops reading `base_id`'s work: how many attempts still read
        it; with none left, the record is released. Readers Redis lost (a restart)
        read as none left. Run twice, it counts the attempt out once."""
        readers = self._readers(key, base_id)
        return max(0, int(await self._leave(keys=[key, *readers], args=[base_id, reader])))

    async def step_aside(self, key: str, base_id: str, reader: str) -> None:
        """Attempt `reader` stops reading the work, which goes on for a retry to attach
        to (its replica shuts down): counted out, so that the last attempt to leave
        later still cancels it."""
        await self._step_aside(keys=list(self._readers(key, base_id)), args=[reader])

    @staticmethod
    def _readers(key: str, base_id: str) -> tuple[str, str]:
        """The keys of the readers of `base_id`'s work: their count, and their set of
        attempt ids (see _CLAIM_LUA's comment above)."""
        return f"{key}:readers:{base_id}", f"{key}:attempts:{base_id}"

    async def release(self, key: str, base_id: str) -> None:
        await self._release(keys=[key, *self._readers(key, base_id)], args=[base_id])
