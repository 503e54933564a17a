"""Heartbeat: a live engine stays in the registry through a step longer than its TTL."""

from __future__ import annotations

import time

import pytest
import redis

from tandem.engine.service.heartbeat import Heartbeat
from tandem.engine.service.registry import Registry
from tandem.protocol import Role
from tandem.registry_entry import EngineInfo

TTL = 0.4


def _info(engine_id: str = "e1") -> EngineInfo:
    return EngineInfo(engine_id, "m", str(Role.NORMAL), "h:1")


def _live(registry: Registry) -> set[str]:
    return {e.engine_id for e in registry.live()}


def test_a_long_step_keeps_the_engine_registered(redis_client, keys):
    registry = Registry(redis_client, keys, ttl_seconds=TTL)
    heartbeat = Heartbeat(registry.heartbeat, every=TTL / 4, loop_alive=lambda: True)
    heartbeat.start()
    try:
        heartbeat.beat(_info())
        time.sleep(3 * TTL)  # the loop is busy in one step: no beat from it
        assert _live(registry) == {"e1"}
    finally:
        heartbeat.stop()
    time.sleep(1.5 * TTL)  # stopped: nothing renews the entry any more
    assert _live(registry) == set()


def test_a_stalled_loop_drops_out(redis_client, keys):
    registry = Registry(redis_client, keys, ttl_seconds=TTL)
    alive = [True]
    heartbeat = Heartbeat(registry.heartbeat, every=TTL / 4, loop_alive=lambda: alive[0])
    heartbeat.start()
    try:
        heartbeat.beat(_info())
        alive[0] = False  # hung: the liveness probe will restart it; stop advertising it
        time.sleep(3 * TTL)
        assert _live(registry) == set()
    finally:
        heartbeat.stop()


def test_an_engine_counts_as_registered_only_once_a_beat_landed(redis_client, keys):
    # /readyz waits for this: a ready engine the gateway cannot see would get 404s.
    registry = Registry(redis_client, keys, ttl_seconds=TTL)

    def unreachable(info: EngineInfo) -> None:
        raise redis.ConnectionError("redis is down")

    failing = Heartbeat(unreachable, every=TTL, loop_alive=lambda: True)
    with pytest.raises(redis.ConnectionError):
        failing.beat(_info())
    assert not failing.registered
    heartbeat = Heartbeat(registry.heartbeat, every=TTL, loop_alive=lambda: True)
    assert not heartbeat.registered
    heartbeat.beat(_info())
    assert heartbeat.registered and _live(registry) == {"e1"}


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="heartbeat interval"):
        Heartbeat(lambda info: None, every=0, loop_alive=lambda: True)
