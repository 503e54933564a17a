"""The `engines` fixture: real engine processes on the test's Redis prefix.

Suites differ in how an engine is started and when it counts as up, so each
makes the fixture with what it needs, in its conftest or test module:

    engines = engines_fixture(launch=start_engine, ready=wait_served)

`engines(role, *flags)` starts one and returns it once `ready` passed; every
engine started is stopped at the end of the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.engines import EngineProcess
from tandem.keys import Keys

Launch = Callable[..., EngineProcess]  # (role, redis_url, keys, log_dir, *flags)
StartEngine = Callable[..., EngineProcess]  # (role, *flags)


def launch(role: str, redis_url: str, keys: Keys, log_dir: Path, *flags: str) -> EngineProcess:
    return EngineProcess(role, redis_url, keys, list(flags), log_dir=log_dir).start()


def engines_fixture(
    launch: Launch = launch,
    ready: Callable[[EngineProcess], EngineProcess] = EngineProcess.wait_ready,
):
    @pytest.fixture(name="engines")
    def engines(redis_url, keys, tmp_path) -> Iterator[StartEngine]:
        started: list[EngineProcess] = []

        def start(role: str, *flags: str) -> EngineProcess:
            proc = launch(role, redis_url, keys, tmp_path, *flags)
            started.append(proc)
            return ready(proc)

        yield start
        for proc in started:
            proc.stop()

    return engines
