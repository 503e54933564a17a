"""Fixtures of the engine service's tests: the engines and a client of their Redis."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.engine_fixture import engines_fixture
from support.engines import Client, EngineProcess

engines = engines_fixture()


@pytest.fixture
def client(redis_url, keys):
    """Submits requests and reads their responses, as a gateway would (the test's Redis)."""
    c = Client(redis_url, keys)
    yield c
    c.close()


@pytest.fixture
def start_group(redis_url, keys, tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    """Starts two-rank groups of normal `tandem engine`s (extra flags given), their logs
    in the test's folder; each killed at the end if still running."""
    groups: list[EngineProcess] = []

    def start(*extra: str) -> EngineProcess:
        flags = ["--data-parallel-size", "2", *extra]
        groups.append(EngineProcess("normal", redis_url, keys, flags, log_dir=tmp_path))
        return groups[-1].start()

    yield start
    for group in groups:
        group.stop()
