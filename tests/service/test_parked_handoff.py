"""A handoff a full decoder has no room for goes back to the queue for a decoder that
has. Real engine processes: a prompt engine and two decoders."""

from __future__ import annotations

import signal
import time

import redis
from support.polling import eventually

from tandem.protocol import ErrorCode

# A model slow enough that the first request decodes for seconds.
MEDIUM = ("--model", "random:medium", "--max-model-len", "2048", "--claim-idle-ms", "60000")
SAMPLING = {"temperature": 0.0, "ignore_eos": True}


def test_a_parked_handoff_goes_to_a_decoder_with_room(engines, client, redis_url, keys):
    # The full decoder kept it until its own first request ended, however long that
    # took, while a decoder started for the load sat idle.
    _two_handoffs_waiting(engines, client, redis_url, keys)
    first = engines("completion", *MEDIUM, "--num-kv-blocks", "128")
    assert eventually(lambda: first.metric("tandem_engine_kv_cache_usage") > 0, 30)
    second = engines("completion", *MEDIUM, "--num-kv-blocks", "256")
    # The second takes the parked one while the first still decodes its own.
    assert eventually(lambda: second.metric("tandem_engine_requests_total") == 1, 30)
    assert first.metric("tandem_engine_requests_total") == 0
    assert first.metric("tandem_engine_handoffs_parked") == 0


def test_a_draining_decoder_hands_its_parked_handoff_back_at_once(engines, client, redis_url, keys):
    # Draining, it kept the parked one until its own request ended or its drain timed
    # out, while a decoder with room sat idle.
    _two_handoffs_waiting(engines, client, redis_url, keys)
    first = engines("completion", *MEDIUM, "--num-kv-blocks", "128", "--drain-timeout", "120")
    assert eventually(lambda: first.metric("tandem_engine_handoffs_parked") == 1, 30)
    first.process.send_signal(signal.SIGTERM)
    second = engines("completion", *MEDIUM, "--num-kv-blocks", "256")
    assert eventually(lambda: second.metric("tandem_engine_requests_total") == 1, 30)
    assert first.process.poll() is None  # still draining its own request


def test_a_parked_handoff_past_its_deadline_frees_the_prompt_engines_kv_at_once(engines, client):
    # Ended while it waited for room, its offer stayed pinned on the prompt engine until
    # it expired (here 120 s): held for nobody, and read by the autoscaler as work.
    prompt = engines("prompt", *MEDIUM, "--num-kv-blocks", "256", "--handoff-ttl", "120")
    decoder = engines("completion", *MEDIUM, "--num-kv-blocks", "128")
    client.submit(prompt_token_ids=[5] * 549, sampling={"max_tokens": 1400, **SAMPLING})
    assert eventually(lambda: decoder.metric("tandem_engine_kv_cache_usage") > 0, 30)
    deadline = time.time() + 8  # the first decodes for longer: the second waits past it
    parked = client.submit(
        prompt_token_ids=[6] * 1500, sampling={"max_tokens": 8, **SAMPLING}, deadline=deadline
    )
    assert eventually(lambda: decoder.metric("tandem_engine_handoffs_parked") == 1, 30)
    assert time.time() < deadline, "parked after its deadline: this tests nothing"
    assert client.answer(parked, timeout=60).final.error_code == ErrorCode.DEADLINE_EXCEEDED
    # The first request's offer was fetched and released long ago: none is left pinned.
    assert eventually(lambda: prompt.metric("tandem_engine_kv_pinned_requests") == 0, 5)


def test_a_prompt_engine_full_of_offers_waits_for_a_decoder_and_takes_no_more(
    engines, client, redis_url
):
    # Its pool full of KV no decoder had fetched yet, it stepped empty without pause: a
    # pull on the Redis every engine shares every few microseconds (~4,700 a second), a
    # core spent, and prompts taken that it could not start.
    small = ("--num-kv-blocks", "16", "--max-model-len", "128")  # two 100-token prompts
    prompt = engines("prompt", *small, "--handoff-ttl", "120")
    quick = {"max_tokens": 4, **SAMPLING}
    first = [client.submit(prompt_token_ids=[i + 1] * 100, sampling=quick) for i in range(4)]
    assert eventually(lambda: prompt.metric("tandem_engine_kv_pinned_requests") == 2, 60)
    assert prompt.metric("tandem_engine_requests_waiting") == 2  # taken while it had room
    later = client.submit(prompt_token_ids=[9] * 100, sampling=quick)
    with redis.Redis.from_url(redis_url) as conn:
        conn.config_resetstat()
        time.sleep(2)
        pulls = conn.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert pulls < 50, f"{pulls} pulls in 2 s by an engine that can start nothing"
    assert prompt.metric("tandem_engine_requests_waiting") == 2  # the later one left queued
    # A decoder's fetches free the room: every prompt is served, the later one too.
    engines("completion", *small)
    for rid in [*first, later]:
        assert client.answer(rid, timeout=60).final.finish_reason == "length"


def _two_handoffs_waiting(engines, client, redis_url, keys) -> None:
    """Two prefilled requests waiting for a decoder: the first decodes 1,400 tokens; the
    second's prompt (1,500 tokens, 94 blocks) does not fit a 128-block decoder beside
    it (35)."""
    engines("prompt", *MEDIUM, "--num-kv-blocks", "256")
    client.submit(prompt_token_ids=[5] * 549, sampling={"max_tokens": 1400, **SAMPLING})
    client.submit(prompt_token_ids=[6] * 1500, sampling={"max_tokens": 8, **SAMPLING})
    with redis.Redis.from_url(redis_url) as conn:
        stream = keys.handoff_stream("tiny")
        assert eventually(lambda: conn.xlen(stream) == 2, 60), "the prompts were not prefilled"
