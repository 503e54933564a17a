"""A client that goes away cancels its work: the engine frees the KV at once."""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator

import openai
import pytest
import redis
from support.engines import EngineProcess
from support.polling import eventually

from .live import API_KEY, serving_engine

LONG = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    # Seconds of decoding on the tiny model (~1.6 ms a token), so the request is
    # surely still running when the client goes (230 tokens take under 0.4 s).
    "max_tokens": 1900,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def shared_engine(redis_server, shared_keys, tmp_path_factory) -> Iterator[EngineProcess]:
    """This module's NORMAL engine: as conftest's, with room for LONG's 1,900 tokens."""
    logs = tmp_path_factory.mktemp("engine")
    room = ("--max-model-len", "2048", "--num-kv-blocks", "160")
    with serving_engine("normal", redis_server.url, shared_keys, logs, *room) as proc:
        yield proc


def _raw_post(ask: dict, headers: str = "") -> bytes:
    """A chat request as bytes, for a socket that then reads nothing (or leaves)."""
    body = json.dumps(ask).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
        f"Content-Type: application/json\r\n{headers}"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _answered(gateway, status: str) -> float:
    return gateway.metric(
        "tandem_gateway_requests_total", route="/v1/chat/completions", status=status
    )


def test_closing_a_stream_midway_frees_the_kv_on_the_engine(shared_gateway, shared_engine):
    cancelled = shared_engine.metric("tandem_engine_requests_total", outcome="cancelled")
    gone, ok = _answered(shared_gateway, "499"), _answered(shared_gateway, "200")
    client = shared_gateway.openai()
    stream = client.chat.completions.create(
        **{k: v for k, v in LONG.items() if k != "ignore_eos"},
        extra_body={"ignore_eos": True},
        stream=True,
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 3:
            break
    assert shared_engine.metric("tandem_engine_kv_cache_usage") > 0  # it is decoding
    stream.close()
    # At once, not at the engine's next heartbeat (2 s): an engine left idle runs no
    # step to refresh them, and the autoscaler reads both.
    assert eventually(lambda: shared_engine.metric("tandem_engine_kv_cache_usage") == 0, 0.6)
    assert shared_engine.metric("tandem_engine_requests_running") == 0
    assert eventually(
        lambda: (
            shared_engine.metric("tandem_engine_requests_total", outcome="cancelled")
            == cancelled + 1
        )
    )
    assert shared_gateway.metric("tandem_gateway_cancellations_total", why="disconnect") >= 1
    # Counted as a client that left, as without streaming: not as the 200 it began with.
    assert eventually(lambda: _answered(shared_gateway, "499") == gone + 1)
    assert _answered(shared_gateway, "200") == ok
    client.close()


def test_a_non_streaming_client_that_disconnects_cancels_too(shared_gateway, shared_engine):
    cancelled = shared_engine.metric("tandem_engine_requests_total", outcome="cancelled")
    gone = _answered(shared_gateway, "499")
    request = _raw_post(LONG)
    port = shared_gateway.settings.port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        assert eventually(lambda: shared_engine.metric("tandem_engine_kv_cache_usage") > 0)
    # Closed without reading a byte of the answer.
    assert eventually(lambda: shared_engine.metric("tandem_engine_kv_cache_usage") == 0)
    assert eventually(
        lambda: (
            shared_engine.metric("tandem_engine_requests_total", outcome="cancelled")
            == cancelled + 1
        )
    )
    assert eventually(lambda: _answered(shared_gateway, "499") == gone + 1)
    # The gateway is unharmed.
    reply = shared_gateway.openai().chat.completions.create(
        model="tiny", messages=LONG["messages"], max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_cancelled_streams_leave_their_redis_connections_to_the_next_requests(
    shared_gateway, shared_engine, redis_server
):
    # A blocking read cancelled midway made redis-py close its connection: each
    # cancelled stream cost a new one (and a socket in TIME_WAIT).
    info = redis.Redis.from_url(redis_server.url)
    opened = info.info("stats")["total_connections_received"]
    client = shared_gateway.openai()
    for _ in range(10):
        stream = client.chat.completions.create(
            **{k: v for k, v in LONG.items() if k != "ignore_eos"},
            extra_body={"ignore_eos": True},
            stream=True,
        )
        for received, _chunk in enumerate(stream):
            if received >= 3:
                break
        stream.close()
    assert eventually(lambda: shared_engine.metric("tandem_engine_kv_cache_usage") == 0)
    client.close()
    # A few new ones: an abandoned read holds its connection up to a second (its
    # block), while the next request reads on another. Not one per cancel.
    assert info.info("stats")["total_connections_received"] - opened <= 6
    info.close()


@pytest.mark.parametrize("leaves", ["retry", "first"])
def test_an_attempt_that_leaves_does_not_cancel_work_another_still_reads(
    shared_gateway, shared_engine, leaves
):
    # Two attempts with one Idempotency-Key read the same work: the one that gave up
    # cancelled it for both, and the other, still connected, got a 503 "cancelled".
    cancelled = shared_engine.metric("tandem_engine_requests_total", outcome="cancelled")
    headers = {"Idempotency-Key": f"story-{leaves}-{uuid.uuid4().hex}"}
    ask = {k: v for k, v in LONG.items() if k != "ignore_eos"}
    ask |= {"extra_body": {"ignore_eos": True}, "extra_headers": headers}
    patient, impatient = shared_gateway.openai(), shared_gateway.openai(timeout=1.5)
    answers: list = []
    gave_up: list = []

    def wait() -> None:
        answers.append(patient.chat.completions.create(**ask))

    def give_up() -> None:
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(**ask)
        gave_up.append(True)

    first, retry = (wait, give_up) if leaves == "retry" else (give_up, wait)
    threads = [threading.Thread(target=first), threading.Thread(target=retry)]
    threads[0].start()
    assert eventually(lambda: shared_engine.metric("tandem_engine_kv_cache_usage") > 0)
    threads[1].start()  # attaches to the first attempt's work
    for thread in threads:
        thread.join(timeout=60)
    assert gave_up == [True]
    [answer] = answers
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == LONG["max_tokens"]
    assert shared_engine.metric("tandem_engine_requests_total", outcome="cancelled") == cancelled
    patient.close()
    impatient.close()


def test_a_stream_whose_client_stops_reading_ends_at_its_deadline(shared_gateway, shared_engine):
    # The deadline was checked only between reads from Redis: a stream blocked on a
    # full socket never got there, and the engine went on generating for nobody.
    cancelled = shared_gateway.metric("tandem_gateway_cancellations_total", why="deadline")
    ask = {**LONG, "stream": True, "n": 4, "logprobs": True, "top_logprobs": 20}
    # Long enough for its first tokens on a loaded machine (the files run in parallel).
    request = _raw_post(ask, "X-Tandem-Timeout: 6\r\n")
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few tokens
    conn.settimeout(10)
    with conn:
        conn.connect(("127.0.0.1", shared_gateway.settings.port))
        conn.sendall(request)  # and then reads nothing
        assert eventually(lambda: shared_engine.metric("tandem_engine_kv_cache_usage") > 0)
        # Cut 6 s after its start (and 3 s of grace), the client still connected.
        assert eventually(
            lambda: (
                shared_gateway.metric("tandem_gateway_cancellations_total", why="deadline")
                == cancelled + 4
            ),
            timeout=20,
        )
        assert eventually(lambda: shared_engine.metric("tandem_engine_kv_cache_usage") == 0)
        assert shared_gateway.metric("tandem_gateway_requests_in_flight") == 0
