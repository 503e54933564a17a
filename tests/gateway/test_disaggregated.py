"""Through the gateway, PROMPT + COMPLETION engines answer exactly what a NORMAL one does."""

from __future__ import annotations

import uuid

import pytest

from tandem.gateway.auth import KeyStore
from tandem.keys import Keys

from .live import API_KEY, LiveGateway, settings_for, start_engine, wait_served

IDS = [5, 9, 17, 33, 2, 101, 77, 4, 8, 15, 16, 23, 42]
EOS = {"extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def pair(redis_server, tmp_path_factory):
    """A gateway in front of PROMPT + COMPLETION engines, and one in front of a NORMAL one."""
    url, logs = redis_server.url, tmp_path_factory.mktemp("engines")
    split, normal = Keys(f"d{uuid.uuid4().hex[:8]}"), Keys(f"n{uuid.uuid4().hex[:8]}")
    procs = [
        start_engine("prompt", url, split, logs),
        start_engine("completion", url, split, logs),
        start_engine("normal", url, normal, logs),
    ]
    gateways: list[LiveGateway] = []
    try:
        for proc in procs:
            wait_served(proc)
        for keys in (split, normal):
            settings = settings_for(url, keys)
            gateways.append(LiveGateway(settings, KeyStore.load(None, API_KEY)).start())
        yield gateways, procs
    finally:
        for gateway in gateways:
            gateway.stop()
        for proc in procs:
            proc.stop()


def _answers(gateway: LiveGateway, content: str) -> list:
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
    }
    client = gateway.openai()
    greedy = client.chat.completions.create(**chat, **EOS)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**chat, stream=True, **EOS)
        if c.choices
    )
    seeded = client.chat.completions.create(**{**chat, "temperature": 0.8, "seed": 9, "n": 2})
    # The decoder's penalties count the first token, which the prefill engine sampled.
    penalized = client.chat.completions.create(
        **chat, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"5": 2.0}, **EOS
    )
    # The first token's logprobs come from the prefill engine, the rest from the decoder.
    scored = client.chat.completions.create(**chat, logprobs=True, top_logprobs=2, **EOS)
    logprobs = [
        (e.token, round(e.logprob, 3), [t.token for t in e.top_logprobs])
        for e in scored.choices[0].logprobs.content
    ]
    by_ids = client.completions.create(
        model="tiny", prompt=IDS, max_tokens=16, temperature=0, **EOS
    )
    client.close()
    return [
        greedy.choices[0].message.content,
        greedy.usage.prompt_tokens,
        greedy.usage.completion_tokens,
        streamed,
        [c.message.content for c in seeded.choices],
        [c.finish_reason for c in seeded.choices],
        by_ids.choices[0].text,
        penalized.choices[0].message.content,
        logprobs,
    ]


def test_disaggregated_and_normal_engines_answer_alike(pair):
    (split, normal), procs = pair
    disaggregated, plain = _answers(split, "Hello there"), _answers(normal, "Hello there")
    assert disaggregated == plain
    assert plain[2] == 24 and plain[3] == plain[0]
    assert plain[7] != plain[0]  # the penalties changed the greedy answer
    assert len(plain[8]) == 24
    # The decoder really took the KV from the prefill engine.
    assert procs[1].metric("tandem_engine_kv_transfer_bytes_total") > 0


def test_a_first_token_that_is_half_a_character_survives_the_handoff(pair):
    (split, normal), _ = pair
    # Greedy, this prompt's first token is one byte of a multi-byte sequence.
    prompt = "Split prefill from decode."
    assert _answers(split, prompt)[0] == _answers(normal, prompt)[0]
