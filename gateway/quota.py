"""Per-key quotas: requests and tokens per minute, shared by every gateway replica.

Each quota is a token bucket in Redis (a hash: level, updated-at) that refills
at limit/60 per second up to `limit`. One Lua script checks both buckets of a
key and takes from both or from neither, so concurrent requests on several
replicas never overdraw, and a request refused for tokens uses up no request.
Time is Redis's own clock (TIME): replicas with skewed clocks still agree.
A bucket's key expires when it would have refilled: a missing bucket is full.

The tpm bucket is charged before the work runs, from an estimate (prompt
UTF-8 bytes / 4 and stop strings too, 8 a chat message, + max_tokens, per choice),
settled once the answer is whole against the usage the client is told (prompt once, every choice's
completion): unused max_tokens come back, and a prompt the estimate undercounted
is charged in full, the bucket going below zero until it refills. A request
that ends early (an error, a disconnect, its deadline) keeps the estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio as aioredis

from tandem.gateway.auth import ApiKey
from tandem.gateway.errors import GatewayError, rate_limited
from tandem.protocol import as_text

# What both scripts share: Redis's clock, and a bucket's level refilled to now.
_LEVEL_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, limit)
  local state = redis.call('HMGET', key, 'level', 'at')
  local lvl, at = tonumber(state[1]), tonumber(state[2])
  if not lvl or not at then return limit end
  return math.min(limit, lvl + math.max(0, now - at) * limit / 60)
end
-- Kept until it would be full again: longer than a minute below zero (settle).
local function store(key, lvl, limit)
  redis.call('HSET', key, 'level', tostring(lvl), 'at', tostring(now))
  redis.call('PEXPIRE', key, math.max(1, math.ceil((limit - lvl) * 60000 / limit)))
end
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
"""

# KEYS: rpm bucket, tpm bucket, the request's marker. ARGV: rpm limit, tpm limit
# (0: none), token cost, the marker's life in ms. Returns {1, requests left, tokens
# left} when admitted, else {0, quota, seconds until it would pass, requests left,
# tokens left}: quota "rpm", "tpm", or "tpm_size" (the cost exceeds the whole bucket:
# never passes); what is left is '' for a quota the key has not (and an admission run
# again says none). Numbers cross as strings: Redis truncates Lua numbers to integers.
# The marker makes a take that runs again (its reply lost with a dead connection, the
# client's retry) admit without taking twice, and lets a give-back find what was
# taken: it lives as long as the request may (an engine refuses a request it takes
# from the queue, at any time until its deadline).
_TAKE_LUA = (
    """
if redis.call('EXISTS', KEYS[3]) == 1 then return {1} end
"""
    + _LEVEL_LUA
    + """
local r, k
local function left(x) return x and tostring(x) or '' end
if rpm > 0 then r = level(KEYS[1], rpm) end
if tpm > 0 then k = level(KEYS[2], tpm) end
if r and r < 1 then return {0, 'rpm', tostring((1 - r) * 60 / rpm), left(r), left(k)} end
if k and cost > tpm then return {0, 'tpm_size', '0', left(r), left(k)} end
if k and k < cost then
  return {0, 'tpm', tostring((cost - k) * 60 / tpm), left(r), left(k)}
end
if r then r = r - 1; store(KEYS[1], r, rpm) end
if k then k = k - cost; store(KEYS[2], k, tpm) end
redis.call('SET', KEYS[3], '1', 'PX', ARGV[4])
return {1, left(r), left(k)}
"""
)

# Give back what a take took (same KEYS and ARGV[1..3]; ARGV[4] '1': its request slot too),
# once: the marker says it was taken and not yet given back. Returns 1 when it gave back.
_GIVE_BACK_LUA = (
    """
if redis.call('GET', KEYS[3]) ~= '1' then return 0 end
"""
    + _LEVEL_LUA
    + """
if rpm > 0 and ARGV[4] == '1' then store(KEYS[1], math.min(rpm, level(KEYS[1], rpm) + 1), rpm) end
if tpm > 0 then store(KEYS[2], math.min(tpm, level(KEYS[2], tpm) + cost), tpm) end
redis.call('SET', KEYS[3], 'given back', 'KEEPTTL')
return 1
"""
)

# Correct the tpm bucket from what a take charged (ARGV[3]) to what the request used
# (ARGV[4]), once (same KEYS and ARGV[1..3] as a take). Settles after the marker
# expired too (a request longer than a minute); never after a give-back. Returns 1
# when it settled.
_SETTLE_LUA = (
    """
local marker = redis.call('GET', KEYS[3])
if marker == 'given back' or marker == 'settled' then return 0 end
"""
    + _LEVEL_LUA
    + """
local used = tonumber(ARGV[4])
store(KEYS[2], math.min(tpm, level(KEYS[2], tpm) + cost - used), tpm)
redis.call('SET', KEYS[3], 'settled', 'PX', 60000)
return 1
"""
)


# The shortest a take's marker lives: a take run again within it takes nothing twice.
_MIN_HOLD_S = 60.0


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    admitted: bool
    # "rpm", "tpm" or "tpm_size" when refused.
    quota: str = ""
    retry_after: float = 0.0
    # What the key's buckets hold after it (None: a quota the key has not, or not
    # known: an admission run again).
    requests_left: float | None = None
    tokens_left: float | None = None


class Quotas:
    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._take = client.register_script(_TAKE_LUA)
        self._give_back = client.register_script(_GIVE_BACK_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    def bucket_keys(self, name: str) -> list[str]:
        # One hash tag per key name: both buckets (and the markers) on one Cluster slot.
        base = f"{self.prefix}:quota:{{{name}}}"
        return [f"{base}:rpm", f"{base}:tpm"]

    def marker_key(self, name: str, request_id: str) -> str:
        return f"{self.prefix}:quota:{{{name}}}:taken:{request_id}"

    async def take(
        self, key: ApiKey, tokens: int, request_id: str, hold_s: float = _MIN_HOLD_S
    ) -> QuotaDecision:
        """Use one request and `tokens` tokens of the key's quotas, or neither; a
        request id already admitted (within `hold_s`, at least a minute: the request's
        deadline) takes nothing again, and can be given back until then."""
        if key.rpm is None and key.tpm is None:
            return QuotaDecision(True)
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        script_keys = [*self.bucket_keys(key.name), self.marker_key(key.name, request_id)]
        hold_ms = math.ceil(max(hold_s, _MIN_HOLD_S) * 1000)
        args = [key.rpm or 0, key.tpm or 0, tokens, hold_ms]
        reply = [as_text(part) for part in await self._take(keys=script_keys, args=args)]
        if reply[0] == "1":
            return QuotaDecision(True, **_left(reply[1:]))
        return QuotaDecision(False, reply[1], float(reply[2]), **_left(reply[3:]))

    async def give_back(
        self, key: ApiKey, tokens: int, request_id: str, *, request_slot: bool = True
    ) -> None:
        """Return what take() took for `request_id`, once however often it is called: its
        tokens, and its request slot unless `request_slot` is False (an engine that
        refused the request before any token still took it: given back, a key's rpm
        let any number of too-long prompts through the queue and the engines)."""
        if key.rpm is None and key.tpm is None:
            return
        script_keys = [*self.bucket_keys(key.name), self.marker_key(key.name, request_id)]
        args = [key.rpm or 0, key.tpm or 0, tokens, "1" if request_slot else "0"]
        await self._give_back(keys=script_keys, args=args)

    async def settle(self, key: ApiKey, charged: int, used: int, request_id: str) -> None:
        """Charge `used` tokens for `request_id` instead of the `charged` its take took,
        once however often it is called, and never after a give_back."""
        if key.tpm is None or charged == used:
            return
        if used < 0:
            raise ValueError(f"used must be >= 0, got {used}")
        script_keys = [*self.bucket_keys(key.name), self.marker_key(key.name, request_id)]
        await self._settle(keys=script_keys, args=[0, key.tpm, charged, used])

    async def admit(
        self,
        key: ApiKey,
        tokens: int,
        request_id: str,
        hold_s: float,
        default_max_tokens: int | None = None,
    ) -> dict[str, str]:
        """take(), raising the 429 that names the quota when refused;
        `default_max_tokens`: the max_tokens counted for a client that set none.
        Returns the admitted answer's rate-limit headers."""
        decision = await self.take(key, tokens, request_id, hold_s)
        if not decision.admitted:
            raise refusal(key, tokens, decision, default_max_tokens)
        return rate_limit_headers(key, decision)


def _left(parts: list[str]) -> dict[str, float | None]:
    """A reply's requests and tokens left ('' or missing: None)."""
    values = [float(part) if part else None for part in parts] + [None, None]
    return {"requests_left": values[0], "tokens_left": values[1]}


# OpenAI's names of what rate_limit_headers() writes.
RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)


def rate_limit_headers(key: ApiKey, decision: QuotaDecision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers: each quota's limit, what is left, and when its
    bucket is full again (clients pace themselves by them)."""
    headers = {}
    for kind, limit, left in (
        ("requests", key.rpm, decision.requests_left),
        ("tokens", key.tpm, decision.tokens_left),
    ):
        if limit is None or left is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(left)))
        headers[f"x-ratelimit-reset-{kind}"] = _duration((limit - left) * 60 / limit)
    return headers


def _duration(seconds: float) -> str:
    """A time as OpenAI's reset headers write it (Go's durations): 0s, 20ms, 1.5s, 6m0s."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms // 1000}.{ms % 1000:03d}".rstrip("0").rstrip(".") + "s"
    return f"{minutes}m{secs}" if minutes else secs


# OpenAI's code for a key's rate limits, its type "requests" or "tokens" naming the
# limit: clients tell a rate limit from other 429s by them. The metric keeps its reasons.
_OVER_LIMIT = "rate_limit_exceeded"


def refusal(
    key: ApiKey, tokens: int, decision: QuotaDecision, default_max_tokens: int | None = None
) -> GatewayError:
    headers = rate_limit_headers(key, decision)
    if decision.quota == "rpm":
        return rate_limited(
            f"Rate limit reached for requests per minute (rpm) of key {key.name!r}: "
            f"limit {key.rpm}/min",
            _OVER_LIMIT,
            decision.retry_after,
            type="requests",
            reason="rpm_exceeded",
            headers=headers,
        )
    if decision.quota == "tpm_size":
        # A client that set no max_tokens was told to lower what it never set.
        counted, fix = "max_tokens", "lower max_tokens or n"
        if default_max_tokens is not None:
            counted = f"max_tokens, unset: {default_max_tokens}, the default within the context"
            fix = "set max_tokens lower, or n"
        return rate_limited(
            f"Request too large for tokens per minute (tpm) of key {key.name!r}: it needs "
            f"{tokens} tokens (estimated prompt and stop strings + {counted}, per choice), "
            f"the limit is {key.tpm}/min; {fix}, or shorten the prompt or stop strings",
            _OVER_LIMIT,
            None,
            retryable=False,
            type="tokens",
            reason="tpm_exceeded",
            headers=headers,
        )
    return rate_limited(
        f"Rate limit reached for tokens per minute (tpm) of key {key.name!r}: limit "
        f"{key.tpm}/min, this request needs {tokens}",
        _OVER_LIMIT,
        decision.retry_after,
        type="tokens",
        reason="tpm_exceeded",
        headers=headers,
    )
