"""SIGTERM's drain, in process: the signal handler only asks, the loop drains."""

from __future__ import annotations

import threading

from tandem.engine import LLM
from tandem.engine.service.cancellation import CancelListener
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.worker import EngineWorker
from tandem.protocol import Role


def test_a_drain_asked_while_the_loop_holds_a_lock_returns_and_the_loop_drains(
    redis_client, redis_url, keys
):
    # A signal handler runs between two bytecodes of the loop: one that logged, wrote
    # the registry and set the gauges took locks the loop may hold (the queue gauges'
    # among them), and the engine hung for good instead of draining.
    engine = LLM("random:tiny", num_kv_blocks=32, max_model_len=128).engine
    settings = WorkerSettings(
        role=Role.NORMAL, model_name="tiny", engine_id="draining", http_address="", drain_timeout=5
    )
    listener = CancelListener(redis_url, keys)
    metrics = EngineMetrics("tiny", "normal")
    io = RedisIO(redis_client, keys, settings, listener)
    worker = EngineWorker(engine, settings, io, metrics)
    try:
        with metrics.waiting_token_seconds._lock:  # the loop, inside observe_queues
            asked = threading.Thread(target=worker.request_drain, daemon=True)
            asked.start()
            asked.join(timeout=5)
            assert not asked.is_alive(), "request_drain waited for the loop's lock"
        assert not worker.draining  # the loop's next turn drains
        assert worker.run() == 0  # idle: drained at once
        assert worker.draining
    finally:
        listener.close()
