"""A Redis that stops answering for a while (paused: a failover, a fork, SIGSTOP), and a
replica that shuts down, under a live gateway and a stand-in engine (a registry entry;
the test writes its events)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import httpx
import redis
import redis.asyncio as aioredis
from support.polling import eventually

from tandem.engine.service.responses import ResponseWriter
from tandem.gateway.broker import Broker
from tandem.gateway.cancels import Cancel, Cancels
from tandem.gateway.idempotency import IdempotencyLedger
from tandem.gateway.metrics import GatewayMetrics
from tandem.protocol import PRIORITY_NORMAL, ResponseEvent, WorkItem

from .live import STAND_IN


def test_a_stream_whose_deadline_passes_while_redis_pauses_ends_with_its_error(
    stand_in_gateway, keys
):
    # The read held 2 s past the deadline, then the cancel and the stall's look waited a
    # second each on the paused Redis: past the stream's 3 s grace, the stream was cut
    # with no error event (the client read a broken chunked body), logged as a client
    # that stopped reading, and counted a 200.
    live, conn = stand_in_gateway
    timeout = 4.0
    lines: list[str] = []
    failures: list[Exception] = []

    def ask() -> None:
        body = {"model": STAND_IN, "prompt": [5, 9], "max_tokens": 10, "stream": True}
        headers = {"X-Tandem-Timeout": str(timeout)}
        try:
            with (
                live.http(timeout=30) as client,
                client.stream("POST", "/v1/completions", json=body, headers=headers) as response,
            ):
                lines.extend(line for line in response.iter_lines() if line)
        except httpx.HTTPError as exc:
            failures.append(exc)

    started = time.monotonic()
    asking = threading.Thread(target=ask)
    asking.start()
    queue = keys.work_stream(STAND_IN, PRIORITY_NORMAL)
    while conn.xlen(queue) == 0 and time.monotonic() - started < 10:
        time.sleep(0.01)
    rid = WorkItem.from_fields(conn.xrange(queue)[0][1]).request_id
    writer = ResponseWriter(conn, keys, "stand-in-engine")
    writer.add(rid, ResponseEvent.tokens(0, [40], "a", "stand-in-engine"))
    writer.flush()
    pid = conn.info("server")["process_id"]
    time.sleep(max(0.0, timeout - 0.6 - (time.monotonic() - started)))
    os.kill(pid, signal.SIGSTOP)
    try:
        asking.join(20)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not failures, failures
    assert '"code":"deadline_exceeded"' in lines[-1].replace(" ", ""), lines
    # Counted as the response ends, a moment after its last byte.
    assert eventually(lambda: live.metric("tandem_gateway_requests_total", status="504") == 1, 5)
    assert live.metric("tandem_gateway_requests_total", status="200") == 0


def test_work_of_requests_a_stopping_replica_cuts_is_cancelled_unless_shared(
    stand_in_gateway, keys
):
    # Left queued, the work of a request without an Idempotency-Key ran to its end for
    # nobody: its client's retry (the SDKs retry the 500) is a new request. One with a
    # key stays queued for a retry through another replica to attach to.
    live, conn = stand_in_gateway
    answers: dict[str, int] = {}

    def ask(name: str, headers: dict[str, str]) -> None:
        body = {"model": STAND_IN, "prompt": [5, 9], "max_tokens": 10}
        with live.http(timeout=30) as client, contextlib.suppress(httpx.HTTPError):
            answers[name] = client.post("/v1/completions", json=body, headers=headers).status_code

    asking = [
        threading.Thread(target=ask, args=("plain", {})),
        threading.Thread(target=ask, args=("keyed", {"Idempotency-Key": "order-stop"})),
    ]
    for thread in asking:
        thread.start()
    queue = keys.work_stream(STAND_IN, PRIORITY_NORMAL)
    deadline = time.monotonic() + 10
    while conn.xlen(queue) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    ids = {WorkItem.from_fields(f).request_id for _, f in conn.xrange(queue)}
    live.stop()  # its graceful timeout (1 s) passes with both waiting
    for thread in asking:
        thread.join(20)
    left = [WorkItem.from_fields(f).request_id for _, f in conn.xrange(queue)]
    assert len(left) == 1  # the keyed request's work, for a retry to attach to
    (plain,) = ids - set(left)
    assert conn.exists(keys.cancel_key(plain))
    assert live.metric("tandem_gateway_cancellations_total", why="server_stop") == 1


def test_cancels_waiting_for_a_paused_redis_hold_a_stopping_gateway_a_second_at_most(
    redis_server, keys, caplog
):
    # Each given a last try in turn, up to a second each: 15 held the shutdown 15 s,
    # past the pod's grace with dozens. Those given up are said, one line each.
    async def main(pid: int) -> float:
        client = aioredis.Redis.from_url(redis_server.url)
        await client.ping()
        cancels = Cancels(
            Broker(client, keys), IdempotencyLedger(client, keys.prefix), GatewayMetrics()
        )
        os.kill(pid, signal.SIGSTOP)
        try:
            for i in range(15):  # clients leaving during the pause: each cancel kept
                await cancels.cancel(Cancel(f"c-{i}", (f"c-{i}",), "disconnect", None), 0.05)
            started = time.monotonic()
            await cancels.close()
            return time.monotonic() - started
        finally:
            os.kill(pid, signal.SIGCONT)
            await client.aclose()

    pid = redis.Redis.from_url(redis_server.url).info("server")["process_id"]
    took = asyncio.run(main(pid))
    assert took < 2
    gave_up = [r for r in caplog.records if "gave up cancelling" in r.getMessage()]
    assert len(gave_up) == 15
