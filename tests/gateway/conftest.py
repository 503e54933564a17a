"""Fixtures of the gateway tests: live gateways (uvicorn in a thread) and real engines."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from support.engine_fixture import engines_fixture
from support.engines import EngineProcess

from tandem.engine.service.registry import Registry
from tandem.gateway.auth import KeyStore
from tandem.keys import Keys
from tandem.registry_entry import EngineInfo

from .live import (
    API_KEY,
    STAND_IN,
    LiveGateway,
    serving_engine,
    settings_for,
    start_engine,
    wait_served,
)


@pytest.fixture
def start_gateway(redis_url, keys) -> Iterator[Callable[..., LiveGateway]]:
    """Start gateways on the test's Redis prefix; all stopped at the end."""
    started: list[LiveGateway] = []

    def start(key_store: KeyStore | None = None, **overrides) -> LiveGateway:
        if key_store is None and not overrides.get("no_auth"):
            key_store = KeyStore.load(None, API_KEY)
        gateway = LiveGateway(settings_for(redis_url, keys, **overrides), key_store).start()
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


# Engines without the C++ kernels (no compile), each ready and in the registry.
engines = engines_fixture(launch=start_engine, ready=wait_served)


@pytest.fixture(scope="module")
def shared_keys() -> Keys:
    return Keys(prefix=f"g{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def shared_engine(redis_server, shared_keys, tmp_path_factory) -> Iterator[EngineProcess]:
    """One NORMAL engine serving "tiny" for a whole test module."""
    logs = tmp_path_factory.mktemp("engine")
    with serving_engine("normal", redis_server.url, shared_keys, logs) as proc:
        yield proc


@pytest.fixture(scope="module")
def shared_gateway(redis_server, shared_keys, shared_engine) -> Iterator[LiveGateway]:
    """A gateway (key API_KEY) in front of shared_engine, for a whole test module."""
    settings = settings_for(redis_server.url, shared_keys)
    gateway = LiveGateway(settings, KeyStore.load(None, API_KEY)).start()
    yield gateway
    gateway.stop()


@pytest.fixture
def stand_in_gateway(redis_server, keys) -> Iterator[tuple[LiveGateway, redis.Redis]]:
    """A gateway before a stand-in engine of STAND_IN (a registry entry; the test writes
    the engine's events), and a Redis client."""
    conn = redis.Redis.from_url(redis_server.url)
    Registry(conn, keys, ttl_seconds=600).heartbeat(
        EngineInfo("stand-in-engine", STAND_IN, "normal", "127.0.0.1:1")
    )
    live = LiveGateway(settings_for(redis_server.url, keys), KeyStore.load(None, API_KEY)).start()
    yield live, conn
    live.stop()
    conn.close()
