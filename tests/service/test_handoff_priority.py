"""Priorities hold past the handoff: a decoder takes a high request's prefilled KV before
the low ones queued ahead of it. Real engine processes: a prompt engine, then a decoder."""

from __future__ import annotations

import time

import redis
from support.polling import eventually

from tandem.engine.service.registry import Registry
from tandem.engine.service.work_queue import WorkQueue
from tandem.protocol import PRIORITY_HIGH, PRIORITY_LOW, PRIORITY_NORMAL, Role
from tandem.registry_entry import EngineInfo

SHORT = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def test_a_decoder_takes_a_high_priority_handoff_before_low_ones_queued_earlier(
    engines, client, redis_url, keys
):
    # One handoff stream for every priority: in a disaggregated model, where decoders
    # are the bottleneck, a high request finished behind every low one prefilled first.
    with redis.Redis.from_url(redis_url) as conn:  # the streams a decoder makes as it starts
        WorkQueue(conn, keys, "tiny", Role.COMPLETION, "a-decoder-gone").ensure_groups()
    engines("prompt")
    lows = [
        client.submit(prompt_token_ids=[5 + i, 9, 17, 33], sampling=SHORT, priority=PRIORITY_LOW)
        for i in range(3)
    ]
    with redis.Redis.from_url(redis_url) as conn:
        low_stream = keys.handoff_stream("tiny", PRIORITY_LOW)
        assert eventually(lambda: conn.xlen(low_stream) == 3, 60), "the lows not prefilled"
        high = client.submit(
            prompt_token_ids=[8, 9, 17, 33], sampling=SHORT, priority=PRIORITY_HIGH
        )
        high_stream = keys.handoff_stream("tiny", PRIORITY_HIGH)
        assert eventually(lambda: conn.xlen(high_stream) == 1, 60), "the high not prefilled"
        engines("completion", "--max-num-seqs", "1")  # one at a time: the order shows
        for rid in [*lows, high]:
            assert client.answer(rid, timeout=60).ok
        ended = {
            rid: conn.xrevrange(keys.response_stream(rid), count=1)[0][0] for rid in [*lows, high]
        }

    def entry_id(rid: str) -> tuple[int, int]:
        ms, seq = ended[rid].decode().split("-")
        return int(ms), int(seq)

    assert min(ended, key=entry_id) == high


def test_a_high_handoff_goes_where_the_live_decoders_read(engines, client, redis_url, keys):
    # After a rolled-back upgrade the streams of every priority stay, and the decoders
    # live read the normal one alone: high and low requests offered on theirs waited
    # there for their deadlines.
    with redis.Redis.from_url(redis_url) as conn:
        WorkQueue(conn, keys, "tiny", Role.COMPLETION, "a-newer-decoder").ensure_groups()
        registry = Registry(conn, keys, ttl_seconds=600)
        older = EngineInfo("older-decoder", "tiny", Role.COMPLETION.value, "127.0.0.1:1")
        registry.heartbeat(older)
        engines("prompt")
        high_stream = keys.handoff_stream("tiny", PRIORITY_HIGH)
        normal_stream = keys.handoff_stream("tiny", PRIORITY_NORMAL)
        client.submit(prompt_token_ids=[8, 9, 17, 33], sampling=SHORT, priority=PRIORITY_HIGH)
        assert eventually(lambda: conn.xlen(normal_stream) == 1, 60), "not offered"
        assert conn.xlen(high_stream) == 0
        # Replaced by a decoder that reads every priority: the high stream again.
        registry.remove("older-decoder")
        registry.heartbeat(EngineInfo("newer", "tiny", Role.COMPLETION.value, "127.0.0.1:1",
                                      priority_handoffs=True))  # fmt: skip
        time.sleep(5.5)  # the prompt engine's view of the decoders is 5 s old at most
        client.submit(prompt_token_ids=[7, 9, 17, 33], sampling=SHORT, priority=PRIORITY_HIGH)
        assert eventually(lambda: conn.xlen(high_stream) == 1, 60), "not on the high stream"
        assert conn.xlen(normal_stream) == 1
