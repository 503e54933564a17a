"""Cancellation: the key, the notice, and a listener that survives dropped connections."""

import time

import pytest
import redis
from support.polling import eventually

from tandem.engine.service.cancellation import (
    CancelListener,
    cancel,
    cancelled_among,
    is_cancelled,
)
from tandem.protocol import CANCEL_TTL_SECONDS
from tandem.redis_server import RedisServer


def drained_until(listener, wanted, timeout=5.0):
    got = set()
    eventually(lambda: got.update(listener.drain()) or wanted <= got, timeout)
    return got


def test_is_cancelled_and_cancelled_among(redis_client, keys):
    assert not is_cancelled(redis_client, keys, "r1")
    assert cancel(redis_client, keys, "r1") == 0  # nobody listening: the key still holds it
    assert is_cancelled(redis_client, keys, "r1")
    ttl = redis_client.ttl(keys.cancel_key("r1"))
    assert CANCEL_TTL_SECONDS - 5 < ttl <= CANCEL_TTL_SECONDS
    assert cancelled_among(redis_client, keys, ["r0", "r1", "r1"]) == {"r1"}
    assert cancelled_among(redis_client, keys, []) == set()
    with pytest.raises(ValueError, match="request_id"):
        cancel(redis_client, keys, "")


def test_listener_hears_cancellations(redis_client, redis_url, keys):
    with CancelListener(redis_url, keys) as listener:
        assert listener.wait_subscribed(5)
        started = time.monotonic()
        assert cancel(redis_client, keys, "r1") == 1
        cancel(redis_client, keys, "r2")
        assert drained_until(listener, {"r1", "r2"}) == {"r1", "r2"}
        assert time.monotonic() - started < 3  # pushed: milliseconds, but a loaded machine
        assert listener.drain() == set()  # drain clears
        assert not listener.take_gap()


def test_listener_reconnects_after_the_connection_is_killed(redis_client, redis_url, keys):
    name = f"{keys.prefix}-listener"
    listener = CancelListener(
        lambda: redis.Redis.from_url(redis_url, client_name=name), keys, backoff_s=0.05
    )
    try:
        assert listener.wait_subscribed(5)
        # Like CLIENT KILL TYPE pubsub, limited to this test's listener.
        (mine,) = [c for c in redis_client.client_list(_type="pubsub") if c["name"] == name]
        redis_client.client_kill_filter(_id=mine["id"])
        # The gap is reported, so the engine re-checks the keys of what it runs.
        assert eventually(listener.take_gap)
        assert listener.reconnects >= 1
        cancel(redis_client, keys, "after")
        assert "after" in drained_until(listener, {"after"})
    finally:
        listener.close()


def test_listener_survives_a_redis_restart(keys):
    server = RedisServer().start()
    port = server.port
    listener = CancelListener(server.url, keys, backoff_s=0.05, max_backoff_s=0.2)
    try:
        assert listener.wait_subscribed(5)
        server.stop()
        time.sleep(0.3)  # the listener is now failing to connect, backing off
        server = RedisServer(port).start()
        client = redis.Redis.from_url(server.url)
        # Notices sent before the listener is back are lost (that is the gap);
        # keep cancelling until one arrives.
        got: set[str] = set()

        def heard():
            cancel(client, keys, "r1")
            got.update(listener.drain())
            return "r1" in got

        assert eventually(heard, timeout=10)
        assert listener.take_gap()
        client.close()
    finally:
        listener.close()
        server.stop()


def test_close_stops_the_thread_promptly(redis_url, keys):
    listener = CancelListener(redis_url, keys)
    listener.wait_subscribed(5)
    started = time.monotonic()
    listener.close()
    assert not listener._thread.is_alive()
    assert time.monotonic() - started < 2


def test_factory_source_and_input_checks(redis_url, redis_client, keys):
    made = []

    def factory():
        made.append(redis.Redis.from_url(redis_url, decode_responses=True))
        return made[-1]

    with CancelListener(factory, keys) as listener:
        assert listener.wait_subscribed(5)
        cancel(redis_client, keys, "r1")
        assert drained_until(listener, {"r1"}) == {"r1"}
    assert len(made) == 1
    with pytest.raises(ValueError, match="source"):
        CancelListener(42, keys)
    with pytest.raises(ValueError, match="backoff"):
        CancelListener(redis_url, keys, backoff_s=0)
