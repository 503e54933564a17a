"""A decoder that will not fetch a handoff's KV tells its prompt engine, which frees it.

Real engine processes: a prompt engine and a decoder of another dtype (another
fingerprint: the KV cannot move between them), as during a rollout.
"""

from __future__ import annotations

from support.polling import eventually

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
