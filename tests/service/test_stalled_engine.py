"""An engine back from a long stall whose requests another engine finished meanwhile.

Real engine processes on a real Redis: one stopped (SIGSTOP) past the claim timeout,
another that takes its request over and finishes it, then the first resumed after
the request's response stream expired (as it does a minute after its answer was
delivered). The entry's absence from the pending list read as Redis having lost it,
and the first engine ran the request again to its end, for nobody.
"""

from __future__ import annotations

import signal
import time

import redis
from support.polling import eventually

from tandem.engine.service.data_epoch import DataEpoch
from tandem.protocol import EventKind, ResponseEvent

PROMPT = [5, 9, 17, 33, 2, 101, 77, 4, 8, 15, 16, 23, 42]
LONG = ("--max-model-len", "2048", "--num-kv-blocks", "160", "--claim-idle-ms", "1500")


def test_the_epoch_reads_kept_until_redis_loses_its_data(redis_url, keys):
    conn = redis.Redis.from_url(redis_url)
    epoch = DataEpoch(conn, keys)
    assert not epoch.kept()  # never read: not known
    epoch.note()
    assert epoch.kept() and epoch.kept()
    assert DataEpoch(conn, keys).kept() is False  # another engine's first read
    conn.delete(keys.data_epoch)  # what a FLUSHALL or a restart without data does
    assert not epoch.kept()
    # Nor after: what this engine held then is gone for good, and read against the new
    # epoch it passed for finished elsewhere (its final events dropped).
    assert not epoch.kept()
    conn.close()


def test_a_request_finished_elsewhere_while_an_engine_stalled_is_not_run_again(
    engines, client, keys
):
    first = engines("normal", *LONG)
    sampling = {"max_tokens": 600, "temperature": 0.0, "ignore_eos": True}
    rid = client.submit(prompt_token_ids=PROMPT, sampling=sampling)
    seen = 0
    for event in client.events(rid, timeout=60):
        seen += len(event.token_ids) if event.event == EventKind.TOKENS else 0
        if seen >= 10:
            break
    first.process.send_signal(signal.SIGSTOP)
    try:
        second = engines("normal", *LONG)
        answer = client.answer(rid, timeout=120)
        assert answer.ok and second.engine_id in answer.engines
        stream = keys.response_stream(rid)
        client.redis.expire(stream, 1)  # the gateway's minute after delivery, shortened
        assert eventually(lambda: not client.redis.exists(stream), 10)
    finally:
        first.process.send_signal(signal.SIGCONT)
    assert eventually(lambda: "finished elsewhere while this engine stalled" in first.log(), 30)
    time.sleep(1)
    # A flush the stop cut midway may land as the engine resumes (tokens from before the
    # stall, which readers drop by offset); run again, it would write on to an end.
    events = [ResponseEvent.from_fields(f) for _, f in client.redis.xrange(stream)]
    assert not any(e.is_final for e in events), ("run again", events, first.log())
    assert first.metric("tandem_engine_requests_running") == 0
