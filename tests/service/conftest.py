"""Fixtures of the engine service's tests: the engines and a client of their Redis."""

from __future__ import annotations

import pytest
from support.engine_fixture import engines_fixture
from support.engines import Client

engines = engines_fixture()


@pytest.fixture
def client(redis_url, keys):
    """Submits requests and reads their responses, as a gateway would (the test's Redis)."""
    c = Client(redis_url, keys)
    yield c
    c.close()
