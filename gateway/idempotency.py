"""Idempotency-Key: a retried request finds the work its first attempt queued.

A client whose connection died with a gateway replica (crashed, restarted)
cannot know whether its request was queued. Retried with the same
`Idempotency-Key` header through any replica, the request attaches to the
first attempt's work items and reads their response streams from the start,
instead of queueing the work twice: the first attempt's queued work is never
lost, and never served twice. The record lives in Redis under the caller's
name, so two API keys never share one.

The record is dropped when the gateway cancels the work (the client left or
the deadline passed), so a later retry queues afresh rather than attaching to
a cancelled request.
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

    def key(self, caller: str, idempotency_key: str) -> str:
        if not _KEY.match(idempotency_key):
            raise bad_request(
                "Idempotency-Key must be 1-255 printable ASCII characters without spaces",
                "Idempotency-Key",
            )
        digest = hashlib.sha256(f"{caller}\0{idempotency_key}".encode()).hexdigest()
        return f"{self.prefix}:idem:{digest}"

    async def claim(
        self, key: str, record: IdempotencyRecord, timeout: float
    ) -> IdempotencyRecord | None:
        """Write the record if the key is new (None: go ahead and queue), else
        return the first attempt's record, to attach to. A record for other
        content is a 409: the key was reused for a different request."""
        # It must outlive the work: the deadline, then the response stream's TTL.
        ttl = int(timeout) + RESPONSE_TTL_SECONDS
        payload = json.dumps(asdict(record))
        for _ in range(3):  # a record that expires between SET and GET: try again
            if await self.client.set(key, payload, nx=True, ex=ttl):
                return None
            raw = await self.client.get(key)
            if raw is None:
                continue
            first = IdempotencyRecord(**json.loads(raw))
            if first.base_id == record.base_id:
                # Our own record: the SET ran and its reply was lost, and the client ran it
                # again (a dead connection). Attaching to it would queue nothing.
                return None
            if first.digest != record.digest:
                raise GatewayError(
                    409,
                    "Idempotency-Key was already used for a different request",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                    reason="idempotency_conflict",
                    headers=NO_RETRY,  # the same request would be refused again
                )
            return first
        raise GatewayError(503, "could not record the Idempotency-Key", type="server_error")

    async def release(self, key: str, base_id: str) -> None:
        await self._release(keys=[key], args=[base_id])
