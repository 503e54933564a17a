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
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from tandem.gateway.errors import NO_RETRY, GatewayError, bad_request
from tandem.protocol import RESPONSE_TTL_SECONDS

_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")

# Delete the record only if it is still the one this attempt wrote.
_RELEASE_LUA = """
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['base_id'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# Write the record and its readers' count (1: this attempt) if the key is new, in one
# step: written apart, a retry attaching between them had its count overwritten, and
# the first attempt's leaving then cancelled the work the retry still read. Run again
# after a lost reply, it finds its own record (ARGV[2]) and queues nothing twice.
# Returns nil to go ahead and queue, else the record found.
_CLAIM_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) then
  redis.call('SET', KEYS[2], 1, 'EX', ARGV[3])
  return false
end
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['base_id'] == ARGV[2] then
  redis.call('SET', KEYS[2], 1, 'NX', 'EX', ARGV[3])
  return false
end
return raw
"""

# Count one more reader of the first attempt's work, only while its record is there:
# read apart, the record could be released (its last reader gone, the work cancelled)
# between the look and the count, and the retry attached to cancelled work. 0: gone.
_ATTACH_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw or cjson.decode(raw)['base_id'] ~= ARGV[1] then return 0 end
local readers = redis.call('INCR', KEYS[2])
-- Never shorter than it was: a first attempt with a longer deadline still reads.
if redis.call('TTL', KEYS[2]) < tonumber(ARGV[2]) then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return readers
"""

# One attempt stops reading: with none left, the record goes in the same step, so
# that no retry attaches to work about to be cancelled (it queues afresh instead).
_LEAVE_LUA = """
local left = redis.call('DECR', KEYS[2])
if left <= 0 then
  redis.call('DEL', KEYS[2])
  local raw = redis.call('GET', KEYS[1])
  if raw and cjson.decode(raw)['base_id'] == ARGV[1] then redis.call('DEL', KEYS[1]) end
end
return left
"""


@dataclass(frozen=True)
class IdempotencyRecord:
    base_id: str
    request_ids: list[str]
    created: int
    digest: str


class IdempotencyLedger:
    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._release = client.register_script(_RELEASE_LUA)
        self._leave = client.register_script(_LEAVE_LUA)
        self._claim = client.register_script(_CLAIM_LUA)
        self._attach = client.register_script(_ATTACH_LUA)

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
        payload = json.dumps(asdict(record))
        own = [key, self._readers(key, record.base_id)]
        for _ in range(3):  # a record gone between the claim and the attach: again
            raw = await self._claim(keys=own, args=[payload, record.base_id, ttl])
            if raw is None:
                return None
            first = IdempotencyRecord(**json.loads(raw))
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
            if await self._attach(keys=[key, readers], args=[first.base_id, ttl]):
                return first
        raise GatewayError(503, "could not record the Idempotency-Key", type="server_error")

    async def leave(self, key: str, base_id: str) -> int:
        """An attempt stops reading the work: how many attempts still read it; with
        none left, the record is released. A count Redis lost (a restart) reads as
        none left."""
        left = await self._leave(keys=[key, self._readers(key, base_id)], args=[base_id])
        return max(0, int(left))

    @staticmethod
    def _readers(key: str, base_id: str) -> str:
        return f"{key}:readers:{base_id}"

    async def release(self, key: str, base_id: str) -> None:
        await self._release(keys=[key], args=[base_id])
