"""Per-key limits on requests in flight (an API key's `max_in_flight`), shared by every
gateway replica.

Each request waiting for its answer holds a Redis connection of its replica's pool and
a place in an engine's batch: one key with thousands in flight drained a replica's pool,
and every other key's requests failed with "Lost the connection to Redis". rpm does not
bound it (long answers pile up at any rate), nor does the queue's limit (it counts
waiting work, not work being answered).

One sorted set per key in Redis: a member per request (its id), scored with when its
hold ends (Redis's clock, ms): the request's deadline, past which its gateway answers
it anyway. A replica that dies mid-request leaves its entries, and they lapse then;
entering drops the lapsed first. A place is the work's (its request id), not an
attempt's: an Idempotency-Key retry attached to the work takes none, and the last of
its readers gives it back (one that stops reading while another reads on keeps it). A
give-back Redis did not take (away, or its reply lost) is kept and sent with this
replica's next entry of the key: a blip held a key's places until their deadlines.
"""

from __future__ import annotations

import math

import redis.asyncio as aioredis

from tandem.gateway.auth import ApiKey
from tandem.gateway.errors import GatewayError, rate_limited

# KEYS: the key's set. ARGV: its limit, the request id, the hold in ms, then the ids of
# places given back that Redis did not take then. Returns {1} when the request holds a
# place (a take run again finds its own), else {0, count}.
_ENTER_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit, hold = tonumber(ARGV[1]), tonumber(ARGV[3])
for i = 4, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return {1} end
local count = redis.call('ZCARD', KEYS[1])
if count >= limit then return {0, count} end
redis.call('ZADD', KEYS[1], now + hold, ARGV[2])
if redis.call('PTTL', KEYS[1]) < hold then redis.call('PEXPIRE', KEYS[1], hold) end
return {1}
"""

# A request's hold past its deadline: its gateway answers the deadline by then.
_HOLD_MARGIN_S = 5.0
# When a refused request may try again: places free as answers end, at no known time.
_RETRY_AFTER_S = 1.0
# The most give-backs kept for a key while Redis does not take them (each lapses at its
# deadline anyway).
_MOST_UNRETURNED = 4096


class InFlight:
    def __init__(
        self, client: aioredis.Redis, prefix: str, hold_margin_s: float = _HOLD_MARGIN_S
    ) -> None:
        self.client = client
        self.prefix = prefix
        # How long past its deadline a request holds its place.
        self.hold_margin_s = hold_margin_s
        self._enter = client.register_script(_ENTER_LUA)
        # Per key name, the places given back that Redis has not taken yet.
        self._unreturned: dict[str, set[str]] = {}

    def set_key(self, name: str) -> str:
        return in_flight_key(self.prefix, name)

    async def enter(self, key: ApiKey, request_id: str, timeout_s: float) -> int | None:
        """Hold one of the key's places until `leave` or `timeout_s` (its deadline)
        passed: None when it holds one, else how many requests hold them all."""
        if key.max_in_flight is None:
            return None
        hold_ms = max(1, math.ceil((timeout_s + self.hold_margin_s) * 1000))
        unreturned = sorted(self._unreturned.get(key.name, ()))
        args = [key.max_in_flight, request_id, hold_ms, *unreturned]
        reply = await self._enter(keys=[self.set_key(key.name)], args=args)
        self._returned(key.name, unreturned)
        return None if int(reply[0]) == 1 else int(reply[1])

    async def leave(self, key: ApiKey, request_id: str) -> None:
        """Give back the request's place (once it has its answer, or is refused); kept
        for the key's next entry if Redis does not take it (raising, or cancelled)."""
        if key.max_in_flight is None:
            return
        unreturned = self._unreturned.setdefault(key.name, set())
        if len(unreturned) < _MOST_UNRETURNED:
            unreturned.add(request_id)
        await self.client.zrem(self.set_key(key.name), request_id)
        self._returned(key.name, [request_id])

    def _returned(self, name: str, request_ids: list[str]) -> None:
        unreturned = self._unreturned.get(name)
        if unreturned is not None:
            unreturned.difference_update(request_ids)
            if not unreturned:
                del self._unreturned[name]


def in_flight_key(prefix: str, name: str) -> str:
    """The sorted set of the places in flight of the API key named `name`."""
    # The quotas' hash tag: a key's limits on one Cluster slot.
    return f"{prefix}:quota:{{{name}}}:in-flight"


def in_flight_refusal(key: ApiKey, count: int) -> GatewayError:
    """The 429 of a key whose places in flight are all held: a rate limit, as OpenAI
    codes one, its type naming the limit."""
    return rate_limited(
        f"Too many requests in flight for key {key.name!r}: {count} are being answered, "
        f"its limit is {key.max_in_flight} (max_in_flight); retry as one ends",
        "rate_limit_exceeded",
        _RETRY_AFTER_S,
        type="in_flight",
        reason="in_flight_exceeded",
    )
