"""How long a delivered answer stays in Redis: a minute once its client has it all,
the full TTL while a retry with its Idempotency-Key may still read it."""

from __future__ import annotations

import pytest
import redis

from tandem.protocol import DELIVERED_RESPONSE_TTL_SECONDS, RESPONSE_TTL_SECONDS

ASK = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Count."}],
    "max_tokens": 8,
    "temperature": 0,
}


@pytest.fixture
def conn(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def _ttl(conn, keys, response_id: str) -> int:
    request_id = response_id.removeprefix("chatcmpl-")
    return conn.ttl(keys.response_stream(request_id))


def test_an_answer_delivered_whole_expires_within_a_minute(shared_gateway, shared_keys, conn):
    client = shared_gateway.openai()
    answer = client.chat.completions.create(**ASK)
    streamed = list(client.chat.completions.create(**ASK, stream=True))
    many = client.chat.completions.create(**ASK, n=2)
    client.close()
    for response_id in (answer.id, streamed[0].id):
        assert 0 < _ttl(conn, shared_keys, response_id) <= DELIVERED_RESPONSE_TTL_SECONDS
    for i in range(2):  # each choice's stream
        ttl = _ttl(conn, shared_keys, f"{many.id}-{i}")
        assert 0 < ttl <= DELIVERED_RESPONSE_TTL_SECONDS


def test_an_answer_a_retry_may_read_again_keeps_its_full_ttl(shared_gateway, shared_keys, conn):
    client = shared_gateway.openai()
    answer = client.chat.completions.create(**ASK, extra_headers={"Idempotency-Key": "keep-1"})
    client.close()
    assert _ttl(conn, shared_keys, answer.id) > RESPONSE_TTL_SECONDS - 60
