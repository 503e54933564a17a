"""An engine's failure as an OpenAI SDK meets it: the SDKs retry every 5xx unless the
answer says not to, and a retry queues the request afresh. A live gateway with a
stand-in engine (a registry entry; the test writes the engine's error events)."""

from __future__ import annotations

import threading

import openai
import pytest

from tandem.engine.service.responses import ResponseWriter
from tandem.engine.service.work_queue import WorkQueue
from tandem.protocol import ErrorCode, ResponseEvent, Role

from .live import STAND_IN

MODEL = STAND_IN


@pytest.fixture
def gateway(stand_in_gateway):
    return stand_in_gateway


def _failing_engine(
    conn, keys, code: str, stop: threading.Event
) -> tuple[list[str], threading.Thread]:
    """Takes every request queued for MODEL and answers it with the error `code`, as
    engines would; the ids it took, as it takes them, and its thread (joined before the
    connection closes: a pull on a closed one failed the thread)."""
    taken: list[str] = []

    def run() -> None:
        writer = ResponseWriter(conn, keys, "stand-in-engine")
        queue = WorkQueue(conn, keys, MODEL, Role.NORMAL, "stand-in-engine")
        while not stop.is_set():
            for delivery in queue.pull(8, block_ms=20).work:
                taken.append(delivery.request_id)
                writer.add(delivery.request_id, ResponseEvent.error(code, f"failed: {code}", "e"))
                writer.flush()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return taken, thread


@pytest.mark.parametrize(
    "code, status, retried",
    [
        # Engines kept dying on it: each SDK retry would crash as many engines again.
        (ErrorCode.REDELIVERY_LIMIT, 503, False),
        # The same deadline passes alike (the gateway's own 504).
        (ErrorCode.DEADLINE_EXCEEDED, 504, False),
        # A failed step may pass on another try.
        (ErrorCode.ENGINE_ERROR, 500, True),
    ],
)
def test_the_sdk_retries_only_the_engine_failures_a_retry_may_mend(
    gateway, keys, code, status, retried
):
    live, conn = gateway
    stop = threading.Event()
    taken, engine = _failing_engine(conn, keys, code, stop)
    client = live.openai(max_retries=2)
    try:
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    finally:
        stop.set()
        engine.join(10)
    assert raised.value.status_code == status
    assert raised.value.body["code"] == code
    assert len(taken) == (3 if retried else 1)  # the first try and the SDK's two retries
