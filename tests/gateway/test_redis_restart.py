"""Redis restarts without its data (kill -9, then `tandem up` starts it again on its port).

The gateway still holds every in-flight request's work items: a request Redis
lost is queued again (same id, priority and deadline) and answered, a stream
that had started continues after the tokens its client has, a Redis that stays
gone ends the request with `redis_unreachable`, and /readyz never hangs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from support.polling import eventually

from tandem.engine.service.registry import Registry
from tandem.engine.service.responses import ResponseWriter
from tandem.gateway import recovery
from tandem.gateway.broker import Broker
from tandem.gateway.cancels import Cancel, Cancels
from tandem.gateway.idempotency import IdempotencyLedger, IdempotencyRecord
from tandem.gateway.metrics import GatewayMetrics
from tandem.keys import Keys
from tandem.protocol import PRIORITY_LOW, ResponseEvent, WorkItem
from tandem.redis_server import RedisServer
from tandem.registry_entry import EngineInfo

from .live import API_KEY, serving_engine

IDS = [5, 9, 17, 33, 2, 101, 77, 4]
ASK = {"model": "tiny", "prompt": IDS, "max_tokens": 10, "ignore_eos": True}
HEADERS = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Priority": "low"}


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A Redis of the test's own: it gets killed."""
    with RedisServer() as server:
        yield server


def _served(url: str, keys: Keys) -> redis.Redis:
    """A client, with "tiny" served by a registered engine that takes no work."""
    conn = redis.Redis.from_url(url)
    Registry(conn, keys, ttl_seconds=600).heartbeat(EngineInfo("idle", "tiny", "normal", "x:1"))
    return conn


def _queued(conn: redis.Redis, keys: Keys) -> WorkItem:
    stream = keys.work_stream("tiny", PRIORITY_LOW)
    assert eventually(lambda: conn.xlen(stream) == 1), "nothing queued"
    [(_, fields)] = conn.xrange(stream)
    return WorkItem.from_fields(fields)


def _restart(server: RedisServer) -> redis.Redis:
    server.kill()
    time.sleep(1.0)  # down longer than the client's own retries (about 0.3 s)
    server.start()  # same port, no data
    return redis.Redis.from_url(server.url)


def _ask(url: str, body: dict, out: list, **headers: str) -> threading.Thread:
    def ask() -> None:
        with httpx.Client(base_url=url, headers=HEADERS | headers, timeout=90) as client:
            if not body.get("stream"):
                out.append(client.post("/v1/completions", json=body))
                return
            with client.stream("POST", "/v1/completions", json=body) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        out.append(json.loads(line.removeprefix("data: ")))

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def test_a_request_queued_when_redis_restarts_empty_is_queued_again_and_answered(
    server, keys, start_gateway, tmp_path
):
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url, redis_loss_grace_s=0.2)
    answers: list = []
    asker = _ask(gateway.url, {**ASK, "temperature": 0}, answers)
    before = _queued(conn, keys)

    conn = _restart(server)
    after = _queued(conn, keys)  # queued again, as it was
    assert (after.request_id, after.priority, after.deadline, after.prompt_token_ids) == (
        before.request_id,
        before.priority,
        before.deadline,
        IDS,
    )
    assert gateway.metric("tandem_gateway_requeued_total") == 1
    with serving_engine("normal", server.url, keys, tmp_path):
        asker.join(timeout=90)
        [answer] = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 10
        with gateway.http() as http:  # greedy: what the same request gets now
            again = http.post("/v1/completions", json={**ASK, "temperature": 0}).json()
    assert answer.json()["choices"][0]["text"] == again["choices"][0]["text"]


def test_a_request_a_flushall_lost_is_queued_again(server, keys, start_gateway, monkeypatch):
    # No restart, so no new run_id: a FLUSHALL (or a replica's full resync) lost the
    # work, and the request waited for its deadline, "still queued".
    monkeypatch.setattr(recovery, "RECHECK_S", 0.5)
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url)
    answers: list = []
    asker = _ask(gateway.url, ASK, answers, **{"X-Tandem-Timeout": "5"})
    before = _queued(conn, keys)
    conn.flushall()
    _served(server.url, keys).close()  # the idle engine registers again
    after = _queued(conn, keys)  # queued again, as it was
    assert (after.request_id, after.deadline) == (before.request_id, before.deadline)
    assert gateway.metric("tandem_gateway_requeued_total") == 1
    asker.join(timeout=30)
    conn.close()


def test_a_stream_cut_by_a_redis_restart_continues_after_the_tokens_sent(
    server, keys, start_gateway, tmp_path
):
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url, redis_loss_grace_s=0.2)
    chunks: list = []
    body = {**ASK, "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    streamer = _ask(gateway.url, body, chunks)
    rid = _queued(conn, keys).request_id
    # An engine took it and sent 3 tokens (sampled: a rerun would differ), then
    # Redis lost everything, the engine too.
    writer = ResponseWriter(conn, keys, "e-gone")
    writer.add(rid, ResponseEvent.tokens(0, [40, 41, 42], "abc", "e-gone"))
    writer.flush()
    assert eventually(lambda: any(c["choices"] and c["choices"][0]["text"] for c in chunks))

    conn = _restart(server)
    assert _queued(conn, keys).request_id == rid
    with serving_engine("normal", server.url, keys, tmp_path):
        streamer.join(timeout=90)
    events = [ResponseEvent.from_fields(f) for _, f in conn.xrange(keys.response_stream(rid))]
    # The stream starts with what the client had; the engine resumed after it.
    assert (events[0].engine_id, events[0].token_ids) == ("gateway", [40, 41, 42])
    assert events[1].offset == 3 and events[-1].finish_reason == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "abc" + "".join(e.text for e in events[1:])
    assert chunks[-1]["usage"]["completion_tokens"] == 10


def test_a_redis_that_restarts_with_its_data_gets_nothing_queued_twice(server, keys, start_gateway):
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url, redis_loss_grace_s=0.2)
    answers: list = []
    asker = _ask(gateway.url, ASK, answers, **{"X-Tandem-Timeout": "5"})
    rid = _queued(conn, keys).request_id
    # Queued over a minute ago: only its entry is left to say it is still queued.
    conn.delete(keys.enqueued("tiny", rid))
    run_id = conn.info("server")["run_id"]
    conn.save()  # the restart loads this snapshot: the same data, a new run_id

    conn = _restart(server)
    assert conn.info("server")["run_id"] != run_id
    asker.join(timeout=30)  # noticed, checked, not queued again; nothing took it
    [answer] = answers
    assert answer.status_code == 504
    assert gateway.metric("tandem_gateway_requeued_total") == 0
    # Its deadline passed: the one entry taken back (a second would be left over).
    assert conn.xlen(keys.work_stream("tiny", PRIORITY_LOW)) == 0


def _streaming(server, keys, start_gateway, **headers: str):
    """A stream (outage time 1 s) whose client has its first token."""
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url, redis_outage_s=1.0)
    chunks: list = []
    streamer = _ask(gateway.url, {**ASK, "stream": True}, chunks, **headers)
    rid = _queued(conn, keys).request_id
    writer = ResponseWriter(conn, keys, "e-1")
    writer.add(rid, ResponseEvent.tokens(0, [40], "a", "e-1"))
    writer.flush()
    assert eventually(lambda: chunks)
    return conn, rid, chunks, streamer


def test_a_stream_whose_redis_stays_gone_ends_with_redis_unreachable(server, keys, start_gateway):
    _, _, chunks, streamer = _streaming(server, keys, start_gateway)
    server.kill()
    streamer.join(timeout=30)
    error = chunks[-1]["error"]
    assert error["code"] == "redis_unreachable", error  # the code docs/gateway.md promises
    assert "Lost the connection to Redis" in error["message"]


def test_a_stream_whose_redis_is_paused_ends_when_the_outage_time_is_up(
    server, keys, start_gateway, caplog
):
    # A paused Redis answers nothing: each command waits out the 5 s socket timeout.
    # It was tried three times (15 s) and the outage clock started after that: 30 s
    # for the 10 s the docs promise.
    conn, rid, chunks, streamer = _streaming(server, keys, start_gateway)
    pid = conn.info("server")["process_id"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        streamer.join(timeout=40)
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    error = chunks[-1]["error"]
    assert error["code"] == "redis_unreachable", error
    assert "no answer from Redis for" in error["message"], error
    assert f"ending {rid} with 503: Redis stayed unreachable" in caplog.text  # said, too
    assert took < 6, took  # a read's block (1 s) and grace (2 s), the outage (1 s)
    # Its client was told it failed (and may retry as a new request): the work is
    # cancelled once Redis answers, not run for nobody.
    assert eventually(lambda: conn.exists(keys.cancel_key(rid)) == 1, timeout=10)


def test_work_a_retry_could_attach_to_is_cancelled_once_no_attempt_reads_it(
    server, keys, start_gateway
):
    # With an Idempotency-Key, the attempt answered 503 kept the work for a retry, and
    # never left its readers' count: with no retry (or once the retry's client left),
    # the work ran until its deadline for nobody.
    headers = {"Idempotency-Key": "order-503"}
    conn, rid, chunks, streamer = _streaming(server, keys, start_gateway, **headers)
    pid = conn.info("server")["process_id"]
    os.kill(pid, signal.SIGSTOP)
    try:
        streamer.join(timeout=40)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert chunks[-1]["error"]["code"] == "redis_unreachable"
    assert eventually(lambda: conn.exists(keys.cancel_key(rid)) == 1, timeout=10)
    assert conn.keys(f"{keys.prefix}:idem:*") == []  # a later retry queues afresh


def test_a_deadline_passes_on_time_while_redis_is_paused(server, keys, start_gateway):
    # Its 504 waited for a read's socket timeout (5 s, three times), the cancel and
    # the stall's registry read (until Redis answered): 47 s for a 4 s deadline.
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url)
    answers: list = []
    asker = _ask(gateway.url, ASK, answers, **{"X-Tandem-Timeout": "3"})
    _queued(conn, keys)
    pid = conn.info("server")["process_id"]
    started = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        asker.join(timeout=40)
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    [answer] = answers
    assert answer.status_code == 504 and answer.json()["error"]["code"] == "deadline_exceeded"
    assert took < 8, took


def _get_while_paused(http: httpx.Client, pid: int, path: str) -> tuple[httpx.Response, float]:
    """GET `path` while the Redis of process `pid` is paused (SIGSTOP: connections
    open, nothing answers), and the seconds it took."""
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        answer = http.get(path)
        return answer, time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_request_while_redis_is_paused_is_a_503_within_a_second_or_so(
    server, keys, start_gateway
):
    # Admission's reads (Redis' run_id, the served models) waited a socket timeout each:
    # 10 s for the 503, whatever the request's deadline.
    conn = _served(server.url, keys)
    pid = conn.info("server")["process_id"]
    gateway = start_gateway(redis_url=server.url)
    with gateway.http() as http:
        time.sleep(1.2)  # what the gateway read at its start is stale: it must ask again
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            answer = http.post("/v1/completions", json=ASK, headers={"X-Tandem-Timeout": "2"})
            took = time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
    assert answer.status_code == 503 and took < 3, (answer.status_code, took)
    assert answer.json()["error"]["code"] == "redis_unreachable"


def test_requests_are_admitted_while_streams_hold_every_pooled_connection(
    server, keys, start_gateway
):
    # Admission's reads have a pool of their own: waiting behind the streams' XREAD
    # BLOCKs for a connection is not Redis failing to answer (a healthy Redis answered
    # 503 redis_unreachable when the reads were timed in the shared pool).
    conn = _served(server.url, keys)
    # 16 requests answered at once: past the default shedding (twice the pool).
    gateway = start_gateway(redis_url=server.url, redis_max_connections=4, max_answering=16)
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Tandem-Timeout": "3"}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=30) as http:
            holding = [asyncio.ensure_future(http.post("/v1/completions", json=ASK))
                       for _ in range(8)]  # fmt: skip
            await asyncio.sleep(1.0)
            late = await asyncio.gather(*(http.post("/v1/completions", json=ASK) for _ in range(8)))
            await asyncio.gather(*holding)
            return [answer.status_code for answer in late]

    assert asyncio.run(burst()) == [504] * 8  # queued, and nobody served them
    conn.close()


def test_readyz_answers_within_its_timeout_while_redis_is_paused(server, keys, start_gateway):
    conn = redis.Redis.from_url(server.url)
    pid = conn.info("server")["process_id"]  # SIGSTOP: connections open, nothing answers
    gateway = start_gateway(redis_url=server.url)
    with gateway.http() as http:
        assert http.get("/readyz").status_code == 200
        paused, took = _get_while_paused(http, pid, "/readyz")
        assert paused.status_code == 503 and took < 3, (paused.status_code, took)
        assert paused.json()["error"] == {
            "message": "Redis did not answer within 1 s",
            "type": "server_error",
            "param": None,
            "code": "redis_unreachable",
        }
        assert http.get("/readyz").status_code == 200  # the timed-out connection is not reused


def test_metrics_answer_while_redis_is_paused(server, keys, start_gateway):
    # An outage is when the gateway's counters matter most: a scrape that waited on
    # Redis failed (503 after 5 s), and the gateway read as down to Prometheus.
    conn = _served(server.url, keys)
    pid = conn.info("server")["process_id"]
    gateway = start_gateway(redis_url=server.url, models_cache_s=0)
    engines = 'tandem_gateway_engines{model="tiny",role="normal"} 1.0'
    with gateway.http() as http:
        assert engines in http.get("/metrics").text
        paused, took = _get_while_paused(http, pid, "/metrics")
        assert paused.status_code == 200 and took < 3, (paused.status_code, took)
        assert "tandem_gateway_redis_up 0.0" in paused.text
        assert engines in paused.text  # as last read
        # Back once a reading succeeds (the one the pause held ends first, failed).
        assert eventually(lambda: "tandem_gateway_redis_up 1.0" in http.get("/metrics").text)


def test_a_full_redis_is_a_503_that_says_so(server, keys, start_gateway):
    # maxmemory with noeviction, the chart's Redis: it answers, but queues nothing.
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url)
    conn.config_set("maxmemory-policy", "noeviction")
    conn.config_set("maxmemory", 1)
    try:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        with httpx.Client(base_url=gateway.url, headers=HEADERS, timeout=30) as client:
            reply = client.post("/v1/completions", json=body)
    finally:
        conn.config_set("maxmemory", 0)
        conn.close()
    assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
    error = reply.json()["error"]
    assert error["message"].startswith("Redis is full (maxmemory) and takes no new writes: ")
    assert "user_script" not in error["message"]  # not a Lua script's internals
    assert error["code"] == "redis_unreachable"


def test_a_model_whose_engines_lapsed_while_redis_is_full_is_a_503_not_unknown(
    server, keys, start_gateway
):
    # A full Redis refuses the engines' heartbeats: their registry entries expire, and
    # 20 s on every request was a 404 "does not exist", which no SDK retries.
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url)
    conn.config_set("maxmemory-policy", "noeviction")
    conn.config_set("maxmemory", 1)
    try:
        conn.delete(keys.engine_key("idle"))  # as its TTL would (a delete is let through)
        conn.srem(keys.engines_set, "idle")
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        with httpx.Client(base_url=gateway.url, headers=HEADERS, timeout=30) as client:
            time.sleep(1.2)  # past the gateway's cached list of models
            reply = client.post("/v1/completions", json=body)
    finally:
        conn.config_set("maxmemory", 0)
        conn.close()
    assert reply.status_code == 503, reply.text
    assert reply.json()["error"]["message"].startswith("Redis is full (maxmemory)")


def test_a_model_served_moments_ago_is_queued_not_unknown(server, keys, start_gateway):
    # After a Redis outage the engines' entries have expired (or were lost) until each
    # beats again: the model looked unknown, and its requests got a 404, which the
    # OpenAI SDKs do not retry.
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url, models_cache_s=0.0)
    with httpx.Client(base_url=gateway.url, headers=HEADERS, timeout=30) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
        Registry(conn, keys).remove("idle")  # its entry expired during the outage
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        reply = client.post("/v1/completions", json=body, headers={"X-Tandem-Timeout": "1"})
    assert reply.status_code == 504, reply.text  # queued, waited for an engine
    assert gateway.metric("tandem_gateway_cancellations_total", why="deadline") == 1
    conn.close()


def test_a_burst_while_redis_is_down_is_refused_at_once(server, keys, start_gateway):
    # Each request waiting on the model directory's lock tried a refresh of its own,
    # one after the other (0.3-0.6 s each): a burst's last waited seconds.
    _served(server.url, keys).close()
    gateway = start_gateway(redis_url=server.url, models_cache_s=0.0)
    server.kill()
    answers: list = []
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    started = time.monotonic()
    threads = [_ask(gateway.url, body, answers) for _ in range(20)]
    for thread in threads:
        thread.join(timeout=30)
    took = time.monotonic() - started
    assert [a.status_code for a in answers] == [503] * 20
    assert took < 3, took


def test_a_client_that_leaves_while_redis_is_paused_is_cancelled_once_it_answers(
    server, keys, start_gateway
):
    # The cancel was tried once (1 s at most) and dropped: the engine generated the
    # whole max_tokens for a client long gone, its KV held all along.
    conn = _served(server.url, keys)
    gateway = start_gateway(redis_url=server.url)
    body = json.dumps(ASK).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nX-Tandem-Priority: low\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    pid = conn.info("server")["process_id"]
    with socket.create_connection(("127.0.0.1", gateway.settings.port), timeout=10) as client:
        client.sendall(head.encode() + body)
        rid = _queued(conn, keys).request_id
        os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # the gateway's own try at the cancel (1 s) has given up
        assert gateway.metric("tandem_gateway_cancellations_total", why="disconnect") == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert eventually(lambda: conn.exists(keys.cancel_key(rid)) == 1, timeout=10)
    # Counted once the gateway has Redis's reply, which may trail the key's write.
    assert eventually(
        lambda: gateway.metric("tandem_gateway_cancellations_total", why="disconnect") == 1,
        timeout=5,
    )


def test_the_loss_check_waits_for_a_paused_redis_a_second_at_most(server, keys):
    # Each read's wake-up asks for Redis's run_id: paused, that waited out the client's
    # socket timeout (5 s), and a deadline or the outage's end waited with it.
    pid = redis.Redis.from_url(server.url).info("server")["process_id"]

    async def check() -> float:
        client = aioredis.Redis.from_url(server.url)
        broker = Broker(client, keys)
        epoch = recovery.RedisEpoch(broker, max_age_s=0.0)
        watch = recovery.LossWatch(
            broker, epoch, [], [], "run", grace_s=0.2, metrics=GatewayMetrics()
        )
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert await watch.requeued(dict) == []
            return time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
            await client.aclose()

    took = asyncio.run(check())
    assert took < recovery.EPOCH_WAIT_S + 0.5, took


def test_a_cancel_whose_task_is_cut_mid_write_is_still_written(server, keys):
    # A stream cut at its deadline cancels the task that was writing its cancel (here
    # waiting for a connection of a busy pool): the cancel was decided, and was lost
    # with the task.
    async def main() -> bool:
        pool = aioredis.BlockingConnectionPool.from_url(server.url, max_connections=1)
        client = aioredis.Redis(connection_pool=pool)
        cancels = Cancels(
            Broker(client, keys), IdempotencyLedger(client, keys.prefix), GatewayMetrics()
        )
        busy = asyncio.create_task(client.blpop(["nothing"], timeout=1))  # the one connection
        await asyncio.sleep(0.1)
        writing = asyncio.create_task(cancels.cancel(Cancel("r1", ("r1",), "deadline", None), 5))
        await asyncio.sleep(0.3)
        writing.cancel()  # the stream's cut
        with pytest.raises(asyncio.CancelledError):
            await writing
        await busy
        deadline = time.monotonic() + 5
        while not await client.exists(keys.cancel_key("r1")) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await cancels.close()
        written = bool(await client.exists(keys.cancel_key("r1")))
        await client.aclose()
        return written

    assert asyncio.run(main())


def test_an_attempt_leaving_shared_work_cancels_it_only_as_its_last_reader(server, keys):
    first = IdempotencyRecord("cmpl-a", ["cmpl-a"], 1, "digest")
    retry = IdempotencyRecord("cmpl-b", ["cmpl-b"], 2, "digest")

    async def main() -> tuple[bool, bool]:
        client = aioredis.Redis.from_url(server.url)
        ledger = IdempotencyLedger(client, keys.prefix)
        cancels = Cancels(Broker(client, keys), ledger, GatewayMetrics())
        key = ledger.key("caller", "order-shared")
        await ledger.claim(key, first, timeout=30)
        await ledger.queued(key, first)
        assert await ledger.claim(key, retry, timeout=30) is not None  # two readers
        leaving = Cancel("cmpl-a", ("cmpl-a",), "redis_unreachable", key, if_last_of="cmpl-a")
        await cancels.cancel(leaving, 5)
        kept = not await client.exists(keys.cancel_key("cmpl-a"))  # the retry reads it
        last = Cancel("cmpl-a", ("cmpl-a",), "redis_unreachable", key, if_last_of="cmpl-b")
        await cancels.cancel(last, 5)
        cancelled = bool(await client.exists(keys.cancel_key("cmpl-a")))
        await cancels.close()
        await client.aclose()
        return kept, cancelled

    assert asyncio.run(main()) == (True, True)
