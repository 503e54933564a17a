"""Gateway replicas in Redis: each one's beat and the work it answers, so that the work
of a replica that died without stopping (SIGKILL, the OOM killer, a lost node) is
cancelled by another.

A replica that stops cancels its requests' work itself (Generation.server_stopping).
One killed cannot: engines ran its queued and running requests for nobody until their
deadlines, and a new stack on the same Redis (`tandem up` after a kill) waited for them.
Each replica beats every `beat_s` in a hash (replica id -> Redis's time of its last
beat) and keeps the request ids of the work it answers that no retry can attach to (no
Idempotency-Key: a retry through another replica attaches to the rest) in a set of its
own, with the places in flight of its keys (max_in_flight) that the work holds. As it
beats, it looks for a replica silent for `lapse_s`: the one whose HDEL removes it (in a
script: once) cancels every request in that replica's set, as a client's disconnect
does, and gives its places back (they held their keys at 429 until their deadlines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tandem.cancel_notice import cancel_commands
from tandem.gateway.in_flight import in_flight_key
from tandem.keys import Keys
from tandem.protocol import as_text

log = logging.getLogger("tandem.gateway")

# KEYS: the replicas' hash. ARGV: this replica's id, the lapse in ms. Beats for this
# replica and returns the ids of those silent for the lapse, each removed (so claimed
# by this call alone).
_BEAT_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], tostring(now))
local silent = {}
local beats = redis.call('HGETALL', KEYS[1])
for i = 1, #beats, 2 do
  if now - tonumber(beats[i + 1]) > tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[1], beats[i])
    table.insert(silent, beats[i])
  end
end
return silent
"""


class Replicas:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, *, beat_s: float = 5.0, lapse_s: float = 30.0
    ) -> None:
        if not 0 < beat_s < lapse_s:
            raise ValueError(f"beat_s ({beat_s}) must be above 0 and below lapse_s ({lapse_s})")
        self.client = client
        self.keys = keys
        # Every beat_s; a replica silent for lapse_s is taken for dead.
        self.beat_s = beat_s
        self.lapse_s = lapse_s
        self.replica_id = uuid.uuid4().hex[:12]
        self._beat = client.register_script(_BEAT_LUA)
        self._task: asyncio.Task[None] | None = None

    @property
    def hash_key(self) -> str:
        return f"{self.keys.prefix}:gateways"

    def work_key(self, replica_id: str) -> str:
        return f"{self.keys.prefix}:gateway:{replica_id}:work"

    def places_key(self, replica_id: str) -> str:
        """A replica's work's places in flight: work id -> its API key's name."""
        return f"{self.keys.prefix}:gateway:{replica_id}:places"

    def start(self) -> None:
        """Beat (and look for dead replicas) on a task of its own until `close`."""
        self._task = asyncio.get_running_loop().create_task(self._beating())

    async def close(self) -> None:
        """Stop beating and leave the hash: a stopped replica is no dead one (its work
        was cancelled, or left for retries, as it stopped)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError, OSError):
            async with asyncio.timeout(1.0):
                pipe = self.client.pipeline(transaction=True)
                pipe.hdel(self.hash_key, self.replica_id)
                pipe.delete(self.work_key(self.replica_id), self.places_key(self.replica_id))
                await pipe.execute()

    async def answering(
        self, request_ids: Iterable[str], place: tuple[str, str] | None = None
    ) -> None:
        """Note work this replica answers (before it is queued: a replica killed just
        after queueing it must not leave it unknown); `place`: (API key name, work id)
        of the key's place in flight it holds."""
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(self.work_key(self.replica_id), *request_ids)
        if place is not None:
            pipe.hset(self.places_key(self.replica_id), place[1], place[0])
        await pipe.execute()

    async def answered(self, request_ids: Iterable[str], work_id: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.srem(self.work_key(self.replica_id), *request_ids)
        pipe.hdel(self.places_key(self.replica_id), work_id)
        await pipe.execute()

    async def beat(self) -> list[str]:
        """One beat: the replicas found dead, whose work this one cancelled."""
        lapse_ms = int(self.lapse_s * 1000)
        args = [self.replica_id, lapse_ms]
        dead = [as_text(r) for r in await self._beat(keys=[self.hash_key], args=args)]
        for replica_id in dead:
            await self._cancel_work_of(replica_id)
        return dead

    async def _cancel_work_of(self, replica_id: str) -> None:
        work, places = self.work_key(replica_id), self.places_key(replica_id)
        request_ids = [as_text(r) for r in await self.client.smembers(work)]
        held = {as_text(w): as_text(n) for w, n in (await self.client.hgetall(places)).items()}
        if request_ids:
            pipe = self.client.pipeline(transaction=True)
            cancel_commands(pipe, self.keys, request_ids)
            await pipe.execute()
        pipe = self.client.pipeline(transaction=False)  # each key's set on its own slot
        for work_id, name in held.items():
            pipe.zrem(in_flight_key(self.keys.prefix, name), work_id)
        pipe.delete(work, places)
        await pipe.execute()
        log.warning(
            "gateway replica %s went silent for %.0f s without stopping: cancelled the work "
            "of its %d requests", replica_id, self.lapse_s, len(request_ids)
        )  # fmt: skip

    async def _beating(self) -> None:
        while True:
            try:
                await self.beat()
            except (RedisError, OSError) as exc:  # Redis away: the next beat tries again
                log.debug("gateway beat: %r", exc)
            await asyncio.sleep(self.beat_s)
