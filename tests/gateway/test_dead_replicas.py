"""A gateway replica killed without stopping (SIGKILL, the OOM killer): another replica
finds it silent and cancels its work, which engines otherwise ran for nobody."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import httpx
import redis
from support.polling import eventually
from support.replicas import run_on_two_clients

from tandem.engine.service.cancellation import is_cancelled
from tandem.engine.service.registry import Registry
from tandem.gateway.auth import ApiKey
from tandem.gateway.in_flight import InFlight
from tandem.gateway.replicas import Replicas
from tandem.registry_entry import EngineInfo

# A model an engine is registered for that takes no work: its requests wait.
WAITING = "ghost-waiting"


def test_a_silent_replicas_work_is_cancelled_once(redis_url, keys):
    async def work(a, b):
        dead = Replicas(a, keys, beat_s=0.05, lapse_s=0.3)
        others = [Replicas(b, keys, beat_s=0.05, lapse_s=0.3) for _ in range(2)]
        key = ApiKey("team", max_in_flight=1)
        places = InFlight(a, keys.prefix)
        assert await places.enter(key, "r1", 600.0) is None
        await dead.answering(["r1"], (key.name, "r1"))
        await dead.answered(["r1"], "r1")  # answered: nothing to cancel
        await places.leave(key, "r1")
        assert await places.enter(key, "r2", 600.0) is None
        await dead.answering(["r2-0", "r2-1"], (key.name, "r2"))
        await dead.beat()
        checker = Replicas(b, keys, beat_s=0.05, lapse_s=0.3)
        assert await checker.beat() == []  # it beat just now: alive
        await checker.close()
        await asyncio.sleep(0.4)  # silent past the lapse
        found = await asyncio.gather(*(o.beat() for o in others))
        left = await a.exists(dead.work_key(dead.replica_id), dead.places_key(dead.replica_id))
        # Its place back: the key's requests were refused until its deadline.
        return dead.replica_id, found, left, await places.enter(key, "r3", 600.0)

    replica_id, found, work_left, entered = run_on_two_clients(redis_url, work)
    assert sorted(found, key=len) == [[], [replica_id]]  # claimed by one of them
    assert not work_left
    assert entered is None  # r2's place given back: r3 holds the key's one
    with redis.Redis.from_url(redis_url) as conn:
        assert [is_cancelled(conn, keys, r) for r in ("r1", "r2-0", "r2-1")] == [
            False,
            True,
            True,
        ]


def test_a_replica_that_stopped_is_not_taken_for_dead(redis_url, keys):
    async def work(a, b):
        stopped = Replicas(a, keys, beat_s=0.05, lapse_s=0.2)
        other = Replicas(b, keys, beat_s=0.05, lapse_s=0.2)
        await stopped.answering(["left-for-a-retry"])
        await stopped.beat()
        await stopped.close()  # its work cancelled, or left for retries, as it stopped
        await asyncio.sleep(0.3)
        return await other.beat()

    assert run_on_two_clients(redis_url, work) == []
    with redis.Redis.from_url(redis_url) as conn:
        assert not is_cancelled(conn, keys, "left-for-a-retry")


def test_a_killed_gateways_waiting_request_is_cancelled_by_another(start_gateway, redis_url, keys):
    with redis.Redis.from_url(redis_url) as conn:
        Registry(conn, keys, ttl_seconds=600).heartbeat(
            EngineInfo("ghost", WAITING, "normal", "127.0.0.1:1")
        )
        beats = {"replica_beat_s": 0.2, "replica_lapse_s": 1.0}
        doomed = start_gateway(**beats)
        ask = {"model": WAITING, "prompt": "x", "max_tokens": 1}
        waiting = threading.Thread(target=_post_quietly, args=(doomed, ask), daemon=True)
        waiting.start()
        replicas = doomed.app.state.gateway.replicas
        work_key = replicas.work_key(replicas.replica_id)
        assert eventually(lambda: conn.scard(work_key) == 1, timeout=5)
        [request_id] = [m.decode() for m in conn.smembers(work_key)]
        # Killed: it beats no more, and nothing cancels its work as a stop would.
        doomed.app.state.gateway.replicas._task.cancel()
        start_gateway(**beats)  # another replica
        assert eventually(lambda: is_cancelled(conn, keys, request_id), timeout=10)
        assert not conn.exists(work_key)


def _post_quietly(gateway, body) -> None:
    with gateway.http(timeout=15) as client, contextlib.suppress(httpx.HTTPError):
        client.post("/v1/completions", json=body, headers={"X-Tandem-Timeout": "8"})
