"""Idempotency-Key through a live gateway, with a stand-in engine: a registry entry, and
the test writing the engine's events (its errors) into the response streams."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from support.polling import eventually

from tandem.engine.service.responses import ResponseWriter
from tandem.gateway.auth import KeyStore
from tandem.protocol import (
    PRIORITY_NORMAL,
    RESPONSE_TTL_SECONDS,
    ErrorCode,
    ResponseEvent,
    Usage,
    WorkItem,
)

from .live import API_KEY, STAND_IN, LiveGateway, settings_for

MODEL = STAND_IN
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def gateway(stand_in_gateway):
    return stand_in_gateway


def _ask(live, key: str, n: int, timeout: float = 60, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": n}
    headers = {"Idempotency-Key": key, "X-Tandem-Timeout": "20"}
    with live.http(timeout=timeout) as client:
        return client.post("/v1/chat/completions", json={**body, "stream": stream}, headers=headers)


def _asking(live, key: str, n: int = 1, **options) -> tuple[threading.Thread, list]:
    """_ask on a thread of its own (the test plays the engine meanwhile): the thread
    and the list its answer lands in."""
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(_ask(live, key, n, **options)))
    thread.start()
    return thread, answers


def _queued(conn, stream: str, count: int, after: int = 0) -> list[str]:
    """The request ids of `count` work entries queued past the first `after`, once there."""
    deadline = time.monotonic() + 10
    while conn.xlen(stream) < after + count and time.monotonic() < deadline:
        time.sleep(0.02)
    entries = conn.xrange(stream)[after:]
    assert len(entries) == count, entries
    return [WorkItem.from_fields(fields).request_id for _, fields in entries]


@pytest.mark.parametrize("n", [1, 2])
def test_a_retry_after_an_engine_failure_runs_the_work_afresh(gateway, keys, n):
    # With n = 1 the record stayed: every retry (the SDKs retry a 5xx) read the same 503
    # again at once for the record's lifetime; with n = 2 it was released.
    live, conn = gateway
    stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
    first: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: first.append(_ask(live, f"order-{n}", n)))
    asking.start()
    deadline = time.monotonic() + 10
    while conn.xlen(stream) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    rid = WorkItem.from_fields(conn.xrange(stream)[0][1]).request_id
    writer = ResponseWriter(conn, keys, "stand-in-engine")
    writer.add(rid, ResponseEvent.error(ErrorCode.REDELIVERY_LIMIT, "delivered 4 times", "e"))
    writer.flush()
    asking.join(30)
    assert first[0].status_code == 503, first[0].text
    queued = conn.xlen(stream)
    retry = threading.Thread(target=lambda: first.append(_ask(live, f"order-{n}", n)))
    retry.start()
    deadline = time.monotonic() + 10
    while conn.xlen(stream) < queued + n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert conn.xlen(stream) == queued + n  # queued afresh, not the old error replayed
    for item in conn.xrange(stream)[queued:]:
        rid = WorkItem.from_fields(item[1]).request_id
        writer.add(rid, ResponseEvent.error(ErrorCode.ENGINE_ERROR, "again", "e"))
    writer.flush()
    retry.join(30)
    assert first[1].json()["error"]["message"] != first[0].json()["error"]["message"]


def test_a_record_of_a_refused_request_outlives_no_refusal_it_points_to(gateway, keys):
    # An engine's 400 left the record for the deadline + 600 s while the refusal's stream
    # lasts 600 s: a retry in between waited for its deadline and got a 504.
    live, conn = gateway
    stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
    writer = ResponseWriter(conn, keys, "stand-in-engine")
    asking, answer = _asking(live, "order-long")
    [rid] = _queued(conn, stream, 1)
    writer.add(rid, ResponseEvent.error(ErrorCode.PROMPT_TOO_LONG, "too long", "e"))
    writer.flush()
    asking.join(30)
    assert answer[0].status_code == 400, answer[0].text
    [record] = _records(conn, keys)
    assert 0 < conn.ttl(record) <= RESPONSE_TTL_SECONDS - 30
    assert _ask(live, "order-long", 1).status_code == 400  # read again while it lasts
    conn.delete(record, keys.response_stream(rid))  # both past their TTL
    retry, again = _asking(live, "order-long")
    [rid] = _queued(conn, stream, 1, after=1)  # queued afresh
    writer.add(rid, ResponseEvent.error(ErrorCode.PROMPT_TOO_LONG, "too long", "e"))
    writer.flush()
    retry.join(30)
    assert again[0].status_code == 400


def test_a_record_outlives_no_answer_it_points_to(gateway, keys):
    # Kept for the deadline + 600 s from the claim while the answer's streams last 600 s
    # from its end: a retry between the two attached to streams gone and waited out its
    # deadline (a 504 that said no engine had started it).
    live, conn = gateway
    stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
    answer: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: answer.append(_ask(live, "order-done", 1)))
    asking.start()
    deadline = time.monotonic() + 10
    while conn.xlen(stream) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    rid = WorkItem.from_fields(conn.xrange(stream)[0][1]).request_id
    writer = ResponseWriter(conn, keys, "stand-in-engine")
    writer.add(rid, ResponseEvent.tokens(0, [5], "Hi", "e"))
    writer.add(rid, ResponseEvent.finish(1, "stop", Usage(3, 1), "e"))
    writer.flush()
    asking.join(30)
    assert answer[0].status_code == 200, answer[0].text
    [record] = _records(conn, keys)
    [count] = conn.keys(f"{keys.prefix}:idem:*:readers:*")
    [readers] = conn.keys(f"{keys.prefix}:idem:*:attempts:*")
    for key in (record, count, readers):
        assert 0 < conn.ttl(key) <= RESPONSE_TTL_SECONDS - 30
    assert conn.ttl(keys.response_stream(rid)) > RESPONSE_TTL_SECONDS - 30


def test_a_record_outlives_no_choice_of_its_answer(gateway, keys):
    # n = 2, the first choice ending long before the second: its stream expired 600 s
    # after its own end, before the record (570 s after the last), and a retry attached
    # to it waited out its deadline for events gone.
    live, conn = gateway
    asking, answer = _asking(live, "order-two", n=2)
    first, second = _queued(conn, keys.work_stream(MODEL, PRIORITY_NORMAL), 2)
    writer = ResponseWriter(conn, keys, "stand-in-engine")
    for rid, text in ((first, "A"), (second, "B")):
        writer.add(rid, ResponseEvent.tokens(0, [5], text, "e"))
        writer.add(rid, ResponseEvent.finish(1, "stop", Usage(3, 1), "e"))
        writer.flush()
        if rid == first:
            conn.expire(keys.response_stream(first), 100)  # as if it ended 500 s ago
    asking.join(30)
    assert answer[0].status_code == 200, answer[0].text
    [record] = _records(conn, keys)
    assert 0 < conn.ttl(record) <= RESPONSE_TTL_SECONDS - 30
    for rid in (first, second):
        assert conn.ttl(keys.response_stream(rid)) > RESPONSE_TTL_SECONDS - 30


@pytest.mark.parametrize("stream", [False, True])
def test_work_whose_first_replica_stopped_is_cancelled_when_its_last_reader_leaves(
    gateway, keys, redis_server, stream
):
    # The stopped replica's attempt still counted as a reader: the retry's client left,
    # and the work ran for nobody until its deadline.
    live, conn = gateway
    other = LiveGateway(settings_for(redis_server.url, keys), KeyStore.load(None, API_KEY))
    other.start()
    try:
        queue = keys.work_stream(MODEL, PRIORITY_NORMAL)
        ask = lambda: _quietly(lambda: _ask(live, "order-roll", 1, stream=stream))  # noqa: E731
        first = threading.Thread(target=ask)
        first.start()
        [rid] = _queued(conn, queue, 1)
        writer = ResponseWriter(conn, keys, "stand-in-engine")
        writer.add(rid, ResponseEvent.tokens(0, [5], "He", "e"))  # the engine generates
        writer.flush()
        time.sleep(0.3)
        live.stop()  # its replica rolled, the attempt cut
        first.join(20)
        with pytest.raises(httpx.ReadTimeout):  # the retry's client gives up
            _ask(other, "order-roll", 1, timeout=1.5)
        assert eventually(lambda: conn.exists(keys.cancel_key(rid)), 5)
        assert conn.xlen(queue) == 1  # the retry attached: the work was queued once
    finally:
        other.stop()


def test_a_reader_leaving_while_redis_pauses_cancels_nothing_another_reads(
    gateway, keys, redis_server, caplog
):
    # Its leave unanswered within a second, the first attempt cancelled as if alone: the
    # other attempt, still reading through another replica, got "the client cancelled
    # the request"; and the leave, run when Redis resumed, counted a reader out twice.
    caplog.set_level(logging.INFO, logger="tandem.gateway")
    live, conn = gateway
    other = LiveGateway(settings_for(redis_server.url, keys), KeyStore.load(None, API_KEY))
    other.start()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"Idempotency-Key": "order-pause", "X-Tandem-Timeout": "30"}
    writer = ResponseWriter(conn, keys, "stand-in-engine")
    # The first client on a bare socket, to leave by closing it at a chosen moment.
    payload = json.dumps(body).encode()
    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        "Content-Type: application/json\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in {**AUTH, **headers}.items())
        + f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    try:
        first = socket.create_connection(("127.0.0.1", live.settings.port))
        first.sendall(request)
        [rid] = _queued(conn, keys.work_stream(MODEL, PRIORITY_NORMAL), 1)
        writer.add(rid, ResponseEvent.tokens(0, [5], "He", "e"))
        writer.flush()
        assert first.recv(4096).startswith(b"HTTP/1.1 200")
        with (
            other.http(timeout=30) as second_client,
            second_client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as second,
        ):
            lines = second.iter_lines()
            assert '"He"' in next(line for line in lines if "He" in line)
            pid = conn.info("server")["process_id"]
            os.kill(pid, signal.SIGSTOP)
            try:
                first.close()  # the first client leaves
                time.sleep(2.5)
            finally:
                os.kill(pid, signal.SIGCONT)
            time.sleep(1.5)  # the deferred leave and cancel decided
            writer.add(rid, ResponseEvent.tokens(1, [6], "llo", "e"))
            writer.add(rid, ResponseEvent.finish(2, "stop", Usage(3, 2), "e"))
            writer.flush()
            rest = "\n".join(lines)
        assert "llo" in rest and '"finish_reason":"stop"' in rest.replace(" ", ""), rest
        assert "cancelled" not in rest
        assert not conn.exists(keys.cancel_key(rid))
        said = [r.getMessage() for r in caplog.records]  # not "cancelled" in the log either
        assert any("left once Redis answered; another attempt reads it" in m for m in said)
        assert not any("once Redis answered" in m and "cancelled" in m for m in said)
    finally:
        other.stop()


def _records(conn, keys) -> list[bytes]:
    """The Idempotency records' keys, without their readers' count and set."""
    found = conn.keys(f"{keys.prefix}:idem:*")
    return [k for k in found if b":readers:" not in k and b":attempts:" not in k]


def _quietly(call) -> None:
    with contextlib.suppress(httpx.HTTPError):
        call()
