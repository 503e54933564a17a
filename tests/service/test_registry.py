"""The engine registry: heartbeats, expiry, filtering by model."""

import time

import pytest

from tandem.engine.service.registry import Registry
from tandem.protocol import Role
from tandem.registry_entry import ENGINE_TTL_SECONDS, EngineInfo

TTL = 0.3


def info(engine_id, model="m1", role=Role.NORMAL, **kwargs):
    return EngineInfo(engine_id, model, str(role), f"{engine_id}:8000", **kwargs)


def test_heartbeats_appear_and_filter_by_model(redis_client, keys):
    registry = Registry(redis_client, keys)
    before = time.time()
    stamped = registry.heartbeat(info("e2", running=3))
    registry.heartbeat(info("e1"))
    registry.heartbeat(info("p1", model="m2", role=Role.PROMPT, kv_address="p1:9000"))
    assert stamped.heartbeat_at >= before
    assert [e.engine_id for e in registry.live()] == ["e1", "e2", "p1"]
    assert [e.engine_id for e in registry.live("m1")] == ["e1", "e2"]
    assert registry.live("nope") == []
    e2 = registry.live("m1")[1]
    assert (e2.running, e2.role, e2.heartbeat_at) == (3, "normal", stamped.heartbeat_at)
    assert {m: [e.engine_id for e in es] for m, es in registry.models().items()} == {
        "m1": ["e1", "e2"],
        "m2": ["p1"],
    }
    ttl = redis_client.pttl(keys.engine_key("e1"))
    assert ENGINE_TTL_SECONDS * 1000 - 2000 < ttl <= ENGINE_TTL_SECONDS * 1000


def test_entries_expire_without_heartbeats_and_are_pruned(redis_client, keys):
    registry = Registry(redis_client, keys, ttl_seconds=TTL)
    registry.heartbeat(info("alive"))
    registry.heartbeat(info("dying"))
    deadline = time.monotonic() + TTL * 2
    while time.monotonic() < deadline:
        registry.heartbeat(info("alive"))
        time.sleep(TTL / 4)
    assert [e.engine_id for e in registry.live()] == ["alive"]
    assert redis_client.smembers(keys.engines_set) == {b"alive"}  # "dying" pruned
    registry.heartbeat(info("dying"))  # it comes back with its next beat
    assert [e.engine_id for e in registry.live()] == ["alive", "dying"]


def test_remove_is_immediate(redis_client, keys):
    registry = Registry(redis_client, keys)
    registry.heartbeat(info("e1"))
    registry.remove("e1")
    assert registry.live() == []
    assert redis_client.scard(keys.engines_set) == 0


def test_unreadable_entries_are_skipped_not_pruned(redis_client, keys):
    registry = Registry(redis_client, keys)
    registry.heartbeat(info("good"))
    for engine_id, raw in (("junk", "not json"), ("list", "[1]"), ("newer", '{"v": "2"}')):
        redis_client.set(keys.engine_key(engine_id), raw)
        redis_client.sadd(keys.engines_set, engine_id)
    assert [e.engine_id for e in registry.live()] == ["good"]
    assert redis_client.scard(keys.engines_set) == 4


def test_input_checks(redis_client, keys):
    with pytest.raises(ValueError, match="ttl_seconds"):
        Registry(redis_client, keys, ttl_seconds=0)
    with pytest.raises(ValueError, match="engine_id"):
        Registry(redis_client, keys).heartbeat(info(""))
