"""A decoder whose requests all wait for their KV takes the next handoff at once: its
fetch runs beside those in flight. An in-process COMPLETION worker, a real Redis, and
a fetch that takes 1 s (no prompt engine: only when each fetch starts is read)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tandem.engine import LLM
from tandem.engine.config import EngineConfig
from tandem.engine.llm import build_engine
from tandem.engine.service.cancellation import CancelListener
from tandem.engine.service.handoff_flow import HandoffFlow
from tandem.engine.service.kv_transfer import KVLayout, TransferStats
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.worker import EngineWorker
from tandem.protocol import Handoff, Role, WorkItem

FETCH_S = 1.0


@pytest.fixture
def decoder(redis_client, redis_url, keys):
    """A COMPLETION worker whose fetches take FETCH_S; `started` notes when each began."""
    loaded = LLM("random:tiny", num_kv_blocks=16, max_model_len=128).loaded
    config = EngineConfig(
        engine_type="completion", max_model_len=128, vocab_size=loaded.config.vocab_size
    )
    engine = build_engine(loaded, config, 64, seed=0)
    settings = WorkerSettings(
        role=Role.COMPLETION, model_name="tiny", engine_id="dec", http_address="",
        fingerprint="fp",
    )  # fmt: skip
    kv = engine.runner.kv_caches
    flow = HandoffFlow(settings, kv, KVLayout.of(kv), config.block_size)
    started: dict[str, float] = {}

    def slow_fetch(**args):
        started[args["handle"]] = time.monotonic()
        time.sleep(FETCH_S)
        return TransferStats(bytes=0, seconds=FETCH_S, layers=0)

    flow.fetches._fetch = slow_fetch
    listener = CancelListener(redis_url, keys)
    io = RedisIO(redis_client, keys, settings, listener)
    worker = EngineWorker(engine, settings, io, EngineMetrics("tiny", "completion"), flow)
    yield worker, started
    flow.close()
    listener.close()


def test_a_handoff_taken_while_a_fetch_runs_is_fetched_beside_it(decoder, redis_client, keys):
    # Its last step ran nothing (the request waited for its KV): the engine waited for
    # the fetch and pulled nothing, so each handoff's fetch waited for the one before.
    worker, started = decoder

    def publish(rid: str) -> None:
        work = WorkItem(rid, "tiny", prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4})
        handoff = Handoff(
            work=dataclasses.asdict(work), prompt_token_ids=[1, 2, 3], first_token_ids=[4],
            kv_address="127.0.0.1:1", kv_handle=rid, kv_token="t", num_kv_tokens=3,
            fingerprint="fp", prompt_engine="p1", expires_at=time.time() + 60,
        )  # fmt: skip
        redis_client.xadd(keys.handoff_stream("tiny"), handoff.to_fields())

    publish("h1")
    deadline = time.monotonic() + 10
    while "h1" not in started and time.monotonic() < deadline:
        worker.run_once()
    while time.monotonic() - started["h1"] < 0.1:
        worker.run_once()
    published = time.monotonic()
    publish("h2")
    while "h2" not in started and time.monotonic() < deadline:
        worker.run_once()
    assert started["h2"] - published < FETCH_S / 2, "the second fetch waited for the first"
