"""A decoder that stalls while it fetches a request's KV, and is taken over meanwhile.

Real engine processes, paused with SIGSTOP: the prompt engine (so the first
decoder's fetch waits on it), then that decoder past --claim-idle-ms (so a second
one claims the handoff). Whatever the first then does, the answer is the second's.
"""

from __future__ import annotations

import signal

import redis
from support.polling import eventually

from tandem.engine import LLM, SamplingParams
from tandem.protocol import HANDOFF_GROUP, ResponseEvent

PROMPT = [5, 9, 17, 33, 2, 101, 77, 4, 8, 15, 16, 23, 42]
GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Claimed after 1.5 s of silence (the keep-alive every 0.375 s); a fetch waits 60 s.
DECODER = ("--claim-idle-ms", "1500", "--kv-fetch-timeout", "60")


def _holder(conn: redis.Redis, stream: str) -> str | None:
    """The engine that holds the handoff entry (pending on it), if any."""
    pending = conn.xpending_range(stream, HANDOFF_GROUP, "-", "+", 1)
    return pending[0]["consumer"].decode() if pending else None


def test_a_decoder_taken_over_mid_fetch_writes_nothing_once_its_fetch_ends(
    engines, client, redis_url, keys
):
    # Its keep-alive found the entry taken while the fetch ran, and let it be: once the
    # KV arrived it decoded, writing into the stream the other decoder served, until the
    # next keep-alive (and a finish there acknowledged the other's entry).
    prompt = engines("prompt", "--handoff-ttl", "60")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 200, **GREEDY})
    conn = redis.Redis.from_url(redis_url)
    stream = keys.handoff_stream("tiny")
    paused = [prompt.process]
    try:
        assert eventually(lambda: conn.xlen(stream) == 1), "no handoff published"
        prompt.process.send_signal(signal.SIGSTOP)  # its KV port accepts, answers nothing
        stalled = engines("completion", *DECODER)
        assert eventually(lambda: _holder(conn, stream) == stalled.engine_id, 30)
        stalled.process.send_signal(signal.SIGSTOP)  # mid-fetch, past the claim idle
        paused.append(stalled.process)
        second = engines("completion", *DECODER)
        assert eventually(lambda: _holder(conn, stream) == second.engine_id, 30)
        stalled.process.send_signal(signal.SIGCONT)  # its keep-alive: taken, still fetching
        assert eventually(lambda: "another engine took over" in stalled.log(), 30)
        prompt.process.send_signal(signal.SIGCONT)  # both fetches get their answers
        answer = client.answer(rid, timeout=60)
    finally:
        for process in paused:
            process.send_signal(signal.SIGCONT)
    assert answer.ok, answer.final
    params = SamplingParams(max_tokens=200, **GREEDY)
    reference = LLM("random:tiny", max_model_len=2048, num_kv_blocks=160)
    [want] = reference.generate(prompt_token_ids=[PROMPT], sampling_params=params)
    assert answer.token_ids == want.token_ids
    # Every event of the request's stream, not only those the reader kept.
    writers = {
        ResponseEvent.from_fields(fields).engine_id
        for _, fields in conn.xrange(keys.response_stream(rid))
    }
    conn.close()
    assert stalled.engine_id not in writers
    assert second.engine_id in writers
