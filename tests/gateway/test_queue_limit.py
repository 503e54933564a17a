"""--max-queue under a burst: a replica's concurrent admissions share one reading of
the backlog, and each reserves its room as it passes the check. A live gateway on a
real Redis, a registry entry of an engine that takes nothing."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
import redis
from support.polling import eventually

from tandem.backlog import queue_depth
from tandem.engine.service.registry import Registry
from tandem.gateway.auth import KeyStore
from tandem.protocol import PRIORITY_NORMAL
from tandem.registry_entry import EngineInfo

from .live import API_KEY, LiveGateway, settings_for

MODEL = "stand-in"
LIMIT = 3


@pytest.fixture
def gateway(redis_server, keys):
    conn = redis.Redis.from_url(redis_server.url)
    Registry(conn, keys, ttl_seconds=600).heartbeat(
        EngineInfo("stand-in-engine", MODEL, "normal", "127.0.0.1:1")
    )
    settings = settings_for(redis_server.url, keys, max_queue=LIMIT)
    live = LiveGateway(settings, KeyStore.load(None, API_KEY)).start()
    yield live, conn
    live.stop()
    conn.close()


def test_a_burst_of_concurrent_requests_queues_no_more_than_the_limit(gateway, keys):
    # All 20 passed the check on one reading of an empty queue (quota and XADD awaited
    # between the check and the count): 19 were queued against a limit of 2.
    live, conn = gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def burst() -> Counter:
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Timeout": "2"}
        async with httpx.AsyncClient(base_url=live.url, headers=headers, timeout=30) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(20))
            )
        return Counter(answer.status_code for answer in answers)

    answered = asyncio.run(burst())
    assert answered == {429: 20 - LIMIT, 504: LIMIT}  # the queued ones: nobody took them
    # Their deadlines passed: taken back out of the queue, as nobody had read them.
    assert conn.xlen(keys.work_stream(MODEL, PRIORITY_NORMAL)) == 0


def test_low_priority_fills_half_the_queue_and_leaves_the_rest_to_the_others(gateway, keys):
    # A key held to low priority filled the whole queue: every tenant's request, high
    # priority too, was refused.
    live, _ = gateway

    async def burst(priority: str, count: int) -> Counter:
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Timeout": "2",
                   "X-Tandem-Priority": priority}  # fmt: skip
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with httpx.AsyncClient(base_url=live.url, headers=headers, timeout=30) as client:
            answers = await asyncio.gather(
                *(client.post("/v1/chat/completions", json=body) for _ in range(count))
            )
        return Counter(answer.status_code for answer in answers)

    async def both() -> tuple[Counter, Counter]:
        low = asyncio.ensure_future(burst("low", 10))
        await asyncio.sleep(0.5)  # the low ones queued first, waiting out their 2 s
        high = await burst("high", 5)
        return await low, high

    low, high = asyncio.run(both())
    assert low == {429: 10 - 2, 504: 2}, low  # half of 3, rounded up
    assert high == {429: 5 - 1, 504: 1}, high  # the room left


def test_work_nobody_waits_for_any_more_leaves_the_queue(gateway, keys):
    # Timed out (504) or left by its client, queued work kept its place until an engine
    # had room to read and drop it: live requests got 429 queue_full meanwhile, and the
    # autoscaler counted the dead work as backlog.
    live, conn = gateway
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=live.url, headers=headers) as client:
        for _ in range(LIMIT):  # the queue filled with work whose deadline passes
            timed_out = client.post(
                "/v1/chat/completions", json=body, headers={"X-Tandem-Timeout": "0.5"}
            )
            assert timed_out.status_code == 504
        with pytest.raises(httpx.ReadTimeout):  # a client that leaves while it waits
            client.post("/v1/chat/completions", json=body, timeout=0.5)
    stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
    assert eventually(lambda: conn.xlen(stream) == 0), conn.xlen(stream)
    assert queue_depth(conn, keys, MODEL).queued_tokens == 0
    with httpx.Client(base_url=live.url, headers=headers) as client:
        again = client.post("/v1/chat/completions", json=body, headers={"X-Tandem-Timeout": "0.5"})
    assert again.status_code == 504, again.text  # queued (nobody serves it), not 429
