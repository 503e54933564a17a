"""One rank of a data-parallel group, in process: it waits for work only when the whole
group is idle (its blocking read holds every other rank's step, through the vote)."""

from __future__ import annotations

import time

import pytest

from tandem.engine import LLM
from tandem.engine.service.cancellation import CancelListener
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.worker import GROUP_POLL_S, EngineWorker
from tandem.protocol import Role


@pytest.fixture
def rank(redis_client, redis_url, keys):
    """An idle rank whose group votes `group_busy` (a MIN vote: 0 is someone busy, 2
    everyone idle; worker.run_once)."""
    engine = LLM("random:tiny", num_kv_blocks=32, max_model_len=128).engine
    settings = WorkerSettings(
        role=Role.NORMAL, model_name="tiny", engine_id="rank-1", http_address=""
    )
    listener = CancelListener(redis_url, keys)
    io = RedisIO(redis_client, keys, settings, listener)
    made = []

    def make(group_busy: bool) -> tuple[EngineWorker, list[int]]:
        metrics = EngineMetrics("tiny", "normal")
        worker = EngineWorker(engine, settings, io, metrics, vote=lambda _: 0 if group_busy else 2)
        waits: list[int] = []
        pull = io.queue.pull

        def spy(count, block_ms=0):
            waits.append(block_ms)
            return pull(count, block_ms)

        io.queue.pull = spy
        made.append(worker)
        return worker, waits

    yield make
    listener.close()


def test_an_idle_rank_of_a_busy_group_never_waits_for_work(rank):
    worker, waits = rank(group_busy=True)
    for _ in range(4):
        worker.run_once()
        time.sleep(GROUP_POLL_S)  # each turn may ask
    # The first turn knows no vote yet; from then on the group is busy.
    assert waits[1:] == [0, 0, 0]


def test_an_idle_rank_of_a_busy_group_asks_redis_only_every_poll_interval(rank):
    worker, waits = rank(group_busy=True)
    started = time.monotonic()
    for _ in range(20):
        worker.run_once()
    turns_of_a_poll = (time.monotonic() - started) / GROUP_POLL_S
    assert len(waits) <= 2 + turns_of_a_poll  # not one round trip a step


def test_an_idle_rank_of_an_idle_group_waits_for_work(rank):
    worker, waits = rank(group_busy=False)
    for _ in range(3):
        worker.run_once()
    assert all(wait > 0 for wait in waits) and len(waits) == 3
