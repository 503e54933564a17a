"""A decoder that will not fetch a handoff's KV tells its prompt engine, which frees it.

Real engine processes: a prompt engine and a decoder of another dtype (another
fingerprint: the KV cannot move between them), as during a rollout; a decoder that
ends or refuses the request as it takes the handoff.
"""

from __future__ import annotations

import time

from support.polling import eventually
from support.response_reader import ResponseReader

from tandem.protocol import ErrorCode

PROMPT = [5, 9, 17, 33, 2, 101, 77, 4, 8, 15, 16, 23, 42]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_a_decoder_of_another_model_recomputes_and_the_prompt_engine_frees_the_kv_at_once(
    engines, client
):
    # Pinned until the offer expired (here 60 s), each such handoff held the prompt
    # engine's KV for nobody: under a rollout's mismatched pairs its pool filled.
    prompt = engines("prompt", "--handoff-ttl", "60")
    decoder = engines("completion", "--dtype", "bfloat16")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 8, **GREEDY})
    answer = client.answer(rid, timeout=60)
    assert answer.ok, answer.final
    assert len(answer.token_ids) == 8
    assert decoder.metric("tandem_engine_kv_transfer_failures_total", reason="mismatch") == 1
    assert eventually(lambda: prompt.metric("tandem_engine_kv_pinned_requests") == 0, 10)
    assert prompt.metric("tandem_engine_kv_cache_usage") == 0


def _pinned(engine) -> float:
    return engine.metric("tandem_engine_kv_pinned_requests")


def test_a_handoff_whose_deadline_passed_in_the_queue_frees_the_prompt_engines_kv(engines, client):
    # Ended as the decoder took it, its KV stayed pinned until the offer expired (here
    # 60 s): held for nobody, and read by the autoscaler as prefill work.
    prompt = engines("prompt", "--handoff-ttl", "60")
    rid = client.submit(
        prompt_token_ids=PROMPT,
        sampling={"max_tokens": 8, **GREEDY},
        deadline=time.time() + 1.5,
    )
    assert eventually(lambda: _pinned(prompt) == 1, 30)
    time.sleep(1.6)  # the deadline passes while the handoff waits for a decoder
    engines("completion")
    answer = client.answer(rid, timeout=60)
    assert answer.final.error_code == ErrorCode.DEADLINE_EXCEEDED
    # Its offset, as written, counts the prompt engine's first token sent before it (it
    # said 0, which readers without the gateway's deduplicator took at its word).
    written = [event for _, event in ResponseReader(client.redis, client.keys).read(rid, "0")]
    assert [e.offset for e in written] == [0, 1] and len(answer.token_ids) == 1
    assert eventually(lambda: _pinned(prompt) == 0, 10)
    assert prompt.metric("tandem_engine_kv_cache_usage") == 0


def test_a_handoff_the_decoder_refuses_frees_the_prompt_engines_kv(engines, client):
    # The decoder's context (128) cannot hold what the prompt engine's (256) prefilled.
    prompt = engines("prompt", "--handoff-ttl", "60")
    engines("completion", "--max-model-len", "128")
    rid = client.submit(prompt_token_ids=PROMPT * 12, sampling={"max_tokens": 8, **GREEDY})
    final = client.answer(rid, timeout=60).final
    assert final.error_code == ErrorCode.PROMPT_TOO_LONG, final
    # After the prompt engine's first token (its offset said 0).
    written = [event for _, event in ResponseReader(client.redis, client.keys).read(rid, "0")]
    assert [e.offset for e in written] == [0, 1]
    assert eventually(lambda: _pinned(prompt) == 0, 10)
    assert prompt.metric("tandem_engine_kv_cache_usage") == 0


def test_a_prompt_engine_of_another_vocabulary_is_the_engines_fault_not_the_request(
    engines, client
):
    # A rollout to a model of another tokenizer: the old prompt engine (8,192 ids)
    # samples a first token the new decoder's vocabulary (512) lacks. Each request was
    # a 400 invalid_request blaming the client, with no mismatch counted or logged.
    prompt = engines("prompt", "--handoff-ttl", "60", "--model", "random:medium")
    decoder = engines("completion")
    rids = [
        client.submit(prompt_token_ids=[p, *PROMPT], sampling={"max_tokens": 8, **GREEDY})
        for p in range(20, 24)
    ]
    answers = [client.answer(rid, timeout=60) for rid in rids]
    foreign = [a for a in answers if a.token_ids and a.token_ids[0] >= 512]
    assert foreign, "every first token in the decoder's vocabulary: this tests nothing"
    for answer in foreign:
        assert answer.final.error_code == ErrorCode.ENGINE_ERROR, answer.final
        assert "serves another model under this name" in answer.final.error_message
    mismatches = decoder.metric("tandem_engine_kv_transfer_failures_total", reason="mismatch")
    assert mismatches == len(answers)  # the others were recomputed, as ever
    assert "serves another model" in decoder.log()
    assert eventually(lambda: _pinned(prompt) == 0, 10)
