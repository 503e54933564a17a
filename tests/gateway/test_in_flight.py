"""A key's requests in flight (max_in_flight) in Redis: exact across replicas, given
back by leave, lapsing at a request's deadline when its gateway died."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from support.replicas import run_on_two_clients

from tandem.gateway.auth import ApiKey
from tandem.gateway.in_flight import InFlight
from tandem.redis_server import free_port


def test_exactly_the_limit_enters_across_replicas(redis_url, keys):
    key = ApiKey("k", max_in_flight=3)

    async def work(a, b):
        replicas = [InFlight(a, keys.prefix), InFlight(b, keys.prefix)]
        return await asyncio.gather(*(replicas[i % 2].enter(key, f"r{i}", 60.0) for i in range(10)))

    refusals = run_on_two_clients(redis_url, work)
    assert refusals.count(None) == 3
    assert all(count == 3 for count in refusals if count is not None)


def test_a_place_comes_back_by_leave_and_an_entry_run_again_takes_none(redis_url, keys):
    key = ApiKey("k", max_in_flight=1)

    async def work(a, _):
        in_flight = InFlight(a, keys.prefix)
        first = await in_flight.enter(key, "r0", 60.0)
        # Its reply lost to a dead connection, redis-py runs the script again.
        again = await in_flight.enter(key, "r0", 60.0)
        refused = await in_flight.enter(key, "r1", 60.0)
        await in_flight.leave(key, "r0")
        after = await in_flight.enter(key, "r1", 60.0)
        return first, again, refused, after

    assert run_on_two_clients(redis_url, work) == (None, None, 1, None)


def test_a_dead_gateways_places_lapse_at_their_deadlines(redis_url, keys):
    key = ApiKey("k", max_in_flight=1)

    async def work(a, _):
        in_flight = InFlight(a, keys.prefix, hold_margin_s=0.0)
        await in_flight.enter(key, "r0", 0.3)  # never left: its gateway died
        refused = await in_flight.enter(key, "r1", 60.0)
        await asyncio.sleep(0.4)
        lapsed = await in_flight.enter(key, "r1", 60.0)
        ttl_ms = await a.pttl(in_flight.set_key("k"))
        return refused, lapsed, ttl_ms

    refused, lapsed, ttl_ms = run_on_two_clients(redis_url, work)
    assert (refused, lapsed) == (1, None)
    assert 59_000 < ttl_ms <= 60_000  # the set lives as long as its latest hold


def test_a_key_without_the_limit_costs_no_redis_call(keys):
    async def work():
        # A client whose every command would fail: none is sent.
        client = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.1)
        in_flight = InFlight(client, keys.prefix)
        entered = await in_flight.enter(ApiKey("k"), "r0", 60.0)
        await in_flight.leave(ApiKey("k"), "r0")
        await client.aclose()
        return entered

    assert asyncio.run(work()) is None


def test_a_give_back_redis_did_not_take_goes_with_the_next_entry(redis_url, keys):
    # Redis away as a request ended (a failover, a fork): its place stayed held until
    # its deadline, and the key got 429s for ten minutes.
    key = ApiKey("k", max_in_flight=1)

    async def work(a, _):
        in_flight = InFlight(a, keys.prefix)
        await in_flight.enter(key, "r0", 600.0)
        nowhere = {"host": "127.0.0.1", "port": free_port(), "socket_connect_timeout": 0.2}
        away = aioredis.Redis(**nowhere, retry=Retry(NoBackoff(), 0))
        in_flight.client = away  # the give-back meets a Redis that is not there
        with pytest.raises(RedisError):
            await in_flight.leave(key, "r0")
        await away.aclose()
        in_flight.client = a
        held = await a.zcard(in_flight.set_key("k"))
        return held, await in_flight.enter(key, "r1", 600.0)

    held, entered = run_on_two_clients(redis_url, work)
    assert held == 1  # still held in Redis
    assert entered is None  # r0's give-back went first
