"""Two gateway replicas on one Redis: either serves, and losing one loses no queued work.

A client whose connection died with its replica cannot know whether its
request was queued. With an Idempotency-Key, its retry through the other
replica attaches to the work the first attempt queued: it is served once,
and the client still gets the whole answer.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import redis
from support.engines import Client

from tandem.engine.service.cancellation import is_cancelled
from tandem.engine.service.registry import Registry
from tandem.protocol import EventKind, WorkItem
from tandem.registry_entry import EngineInfo

from .live import API_KEY

MESSAGES = [{"role": "user", "content": "Which replica answers?"}]
ASK = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}


def test_both_replicas_serve_the_same_models(start_gateway, engines):
    engines("normal")
    a, b = start_gateway(), start_gateway()
    answers = [g.openai().chat.completions.create(**ASK).choices[0].message.content for g in (a, b)]
    assert answers[0] == answers[1]
    assert [m.id for m in a.openai().models.list()] == [m.id for m in b.openai().models.list()]


def test_work_queued_through_a_stopped_replica_is_served_and_a_retry_gets_it(
    start_gateway, engines, redis_url, keys
):
    conn = redis.Redis.from_url(redis_url)
    # An engine is registered (so "tiny" is a served model) but takes no work yet.
    Registry(conn, keys, ttl_seconds=600).heartbeat(
        EngineInfo("busy", "tiny", "normal", "127.0.0.1:1")
    )
    a, b = start_gateway(), start_gateway()
    headers = {"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": "order-42"}
    outcome: dict[str, object] = {}

    def first_attempt() -> None:
        try:
            with httpx.Client(base_url=a.url, timeout=30) as client:
                outcome["reply"] = client.post("/v1/chat/completions", json=ASK, headers=headers)
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=first_attempt)
    thread.start()
    stream = keys.work_stream("tiny", 1)
    deadline = time.monotonic() + 10
    while conn.xlen(stream) == 0:
        assert time.monotonic() < deadline, "the first attempt was never queued"
        time.sleep(0.02)
    [(_, fields)] = conn.xrange(stream)
    queued = WorkItem.from_fields(fields)

    a.stop()  # the replica goes away with the client's connection
    thread.join(timeout=20)
    assert "error" in outcome or outcome["reply"].status_code >= 500
    assert not is_cancelled(conn, keys, queued.request_id)  # the work is still wanted
    assert conn.xlen(stream) == 1

    engine = engines("normal")
    direct = Client(redis_url, keys)
    answer = direct.answer(queued.request_id, timeout=60)  # served, stream complete in Redis
    assert answer.ok and answer.final.event == EventKind.FINISH
    direct.close()

    retry = b.openai().chat.completions.create(**ASK, extra_headers={"Idempotency-Key": "order-42"})
    assert retry.id == f"chatcmpl-{queued.request_id}"
    assert retry.choices[0].message.content == answer.text
    assert retry.usage.completion_tokens == answer.final.usage["completion_tokens"]
    assert engine.metric("tandem_engine_requests_total") == 1  # served once, not twice

    with pytest.raises(openai.ConflictError) as conflict:  # the same key, another request
        b.openai().chat.completions.create(
            **{**ASK, "max_tokens": 3}, extra_headers={"Idempotency-Key": "order-42"}
        )
    # The SDKs retry a 409 unless told not to: it would be refused again, each time.
    assert conflict.value.response.headers["x-should-retry"] == "false"
    fresh = b.openai().chat.completions.create(**ASK)  # B keeps serving new requests
    assert fresh.id != retry.id and fresh.choices[0].message.content == answer.text
    conn.close()


def test_a_streaming_retry_replays_the_whole_answer(start_gateway, engines):
    engines("normal")
    gateway = start_gateway()
    client = gateway.openai()
    key = {"Idempotency-Key": "stream-7"}
    first = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**ASK, stream=True, extra_headers=key)
        if c.choices
    )
    again = client.chat.completions.create(**ASK, extra_headers=key)  # not streamed this time
    assert again.choices[0].message.content == first
