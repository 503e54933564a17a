"""Entries an engine pulled but had not taken when Redis went away, once it is back.

An in-process worker on the session's Redis: the pull is made by hand and the outage
declared, as the loop finds them when a take fails midway. What happens while Redis
is away is the outage tests' (test_redis_outage.py); here, what the worker does with
such entries once Redis answers again.
"""

from __future__ import annotations

import time

import pytest
import redis

from tandem.backlog import enqueue
from tandem.engine import LLM
from tandem.engine.service.cancellation import CancelListener
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.work_queue import WorkQueue
from tandem.engine.service.worker import EngineWorker
from tandem.protocol import WORK_GROUP, ResponseEvent, Role, WorkItem

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def stranded(redis_client, redis_url, keys):
    """A worker holding two entries pulled but not taken, with Redis declared away."""
    engine = LLM("random:tiny", num_kv_blocks=32, max_model_len=128).engine
    settings = WorkerSettings(
        role=Role.NORMAL, model_name="tiny", engine_id="a", http_address="", drain_timeout=30
    )
    listener = CancelListener(redis_url, keys)
    worker = EngineWorker(engine, settings, RedisIO(redis_client, keys, settings, listener),
                          EngineMetrics("tiny", "normal"))  # fmt: skip
    for rid in ("r0", "r1"):
        sampling = {"max_tokens": 4, "temperature": 0.0}
        enqueue(
            redis_client, keys, WorkItem(rid, "tiny", prompt_token_ids=[5, 9], sampling=sampling)
        )
    worker._untaken = list(worker.io.queue.pull(2, 0))
    assert [d.request_id for d in worker._untaken] == ["r0", "r1"]
    worker.outage.failed(redis.ConnectionError("gone"), "two entries pulled, not taken")
    try:
        yield worker
    finally:
        listener.close()


def turn_until(worker: EngineWorker, done) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, "the worker never got there"
        worker.run_once()


def events(redis_client, keys, rid: str) -> list[ResponseEvent]:
    return [ResponseEvent.from_fields(f) for _, f in redis_client.xrange(keys.response_stream(rid))]


def writers(redis_client, keys, rid: str) -> set[str]:
    return {event.engine_id for event in events(redis_client, keys, rid)}


def test_an_entry_another_engine_took_over_meanwhile_is_left_to_it(stranded, redis_client, keys):
    # An outage past --claim-idle-ms: another engine took r0 over. Taken here too, both
    # served it (a sampled answer's stream then mixed two runs, with two final events).
    r0 = stranded._untaken[0]
    assert redis_client.xclaim(r0.stream, WORK_GROUP, "b", 0, [r0.entry_id])
    finished = lambda: any(e.is_final for e in events(redis_client, keys, "r1"))  # noqa: E731
    turn_until(stranded, lambda: finished() and not stranded.held)
    assert writers(redis_client, keys, "r0") == set()
    assert writers(redis_client, keys, "r1") == {"a"}  # still its own: served here
    owners = redis_client.xpending_range(r0.stream, WORK_GROUP, "-", "+", 10)
    assert [(o["message_id"].decode(), o["consumer"].decode()) for o in owners] == [
        (r0.entry_id, "b")
    ]


def test_a_draining_engine_hands_them_back_once_redis_is_back(stranded, redis_client, keys):
    # Asked to drain while Redis was away: they are not started on an engine that is
    # leaving (a long one was cut at the drain's deadline and done again elsewhere).
    stranded.drain()
    turn_until(stranded, lambda: not stranded.outage.down and not stranded._untaken)
    assert not stranded.held
    other = WorkQueue(redis_client, keys, "tiny", Role.NORMAL, "b")
    pulled = other.pull(2, 0)
    assert sorted(d.request_id for d in pulled) == ["r0", "r1"]
    assert all(d.times_delivered == 1 for d in pulled)  # the hand-back counted nothing
    assert writers(redis_client, keys, "r0") == writers(redis_client, keys, "r1") == set()


def test_an_engine_that_started_with_redis_away_notes_the_epoch_before_its_first_pull(
    redis_client, redis_url, keys
):
    # Noted only at the start, it never was: for the process's life a request whose
    # entry vanished (finished by another engine while this one stalled) was run to its
    # end for nobody. The worker here never started: as if Redis had been away then.
    engine = LLM("random:tiny", num_kv_blocks=32, max_model_len=128).engine
    settings = WorkerSettings(role=Role.NORMAL, model_name="tiny", engine_id="a", http_address="")
    listener = CancelListener(redis_url, keys)
    worker = EngineWorker(engine, settings, RedisIO(redis_client, keys, settings, listener),
                          EngineMetrics("tiny", "normal"))  # fmt: skip
    try:
        assert not worker.io.epoch.noted
        sampling = {"max_tokens": 2, "temperature": 0.0}
        enqueue(redis_client, keys, WorkItem("r", "tiny", prompt_token_ids=[5], sampling=sampling))
        turn_until(worker, lambda: worker.held)
        assert worker.io.epoch.noted and worker.io.epoch.kept()
    finally:
        listener.close()
