"""Which engines can finish a request, as admission, deadlines and metrics see them.

A model no controller declares is served only by its live engines: prompt
engines without a decode (completion) engine, or the reverse, can never finish
a request, so it is refused at once (503, Retry-After) rather than queued until
its deadline. A declared model is queued whatever its engines (its controller
brings them, possibly one role after the other), and a deadline that passes
says which engine was missing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import redis
from support.polling import eventually

from tandem import catalog
from tandem.engine.service.registry import Registry
from tandem.gateway.auth import KeyStore
from tandem.protocol import PRIORITY_NORMAL
from tandem.registry_entry import EngineInfo

ASK = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
SHORT = {"X-Tandem-Timeout": "1"}


def _register(redis_url, keys, *roles: str) -> redis.Redis:
    """Registry entries of engines that take no work: only their roles matter here."""
    conn = redis.Redis.from_url(redis_url)
    registry = Registry(conn, keys, ttl_seconds=600)
    for i, role in enumerate(roles):
        registry.heartbeat(EngineInfo(f"{role}-{i}", "tiny", role, "127.0.0.1:1"))
    return conn


def test_an_undeclared_model_with_prompt_engines_only_is_refused_naming_the_decoder(
    start_gateway, redis_url, keys
):
    conn = _register(redis_url, keys, "prompt")
    gateway = start_gateway(models_cache_s=0.0)
    with gateway.http() as http:
        refused = http.post("/v1/completions", json=ASK, headers=SHORT)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
    assert refused.json()["error"] == {
        "message": "No decode (completion) engine is serving 'tiny'; its prompt engines "
        "cannot finish a request alone. Start a completion engine "
        "(tandem engine --role completion) or retry later",
        "type": "server_error",
        "param": "model",
        "code": "missing_engine_role",
    }
    assert conn.xlen(keys.work_stream("tiny", PRIORITY_NORMAL)) == 0  # nothing queued
    assert gateway.metric("tandem_gateway_rejections_total", reason="missing_role") == 1


def test_an_undeclared_model_with_completion_engines_only_is_refused_naming_the_prompt_engine(
    start_gateway, redis_url, keys
):
    _register(redis_url, keys, "completion", "completion")
    gateway = start_gateway(models_cache_s=0.0)
    with gateway.http() as http:
        refused = http.post("/v1/completions", json=ASK, headers=SHORT)
    assert refused.status_code == 503
    message = refused.json()["error"]["message"]
    assert message.startswith("No prompt engine is serving 'tiny'; its decode (completion) "), (
        message
    )


def test_both_roles_or_a_declaration_are_queued_and_the_deadline_says_what_was_missing(
    start_gateway, redis_url, keys
):
    conn = _register(redis_url, keys, "prompt", "completion")
    gateway = start_gateway(models_cache_s=0.0)
    with gateway.http() as http:
        both = http.post("/v1/completions", json=ASK, headers=SHORT)
        assert both.status_code == 504  # queued: these engines take nothing
        assert both.json()["error"]["message"] == (
            "The request did not finish within its deadline of 1 s: no engine had started "
            "it: it waited in the queue or in a busy engine"
        )
        # Declared, with decode engines only: queued for the prompt engine its
        # controller is starting; nothing took it by the deadline.
        conn.delete(keys.engine_key("prompt-0"))
        catalog.declare(conn, keys, "tiny", "test/tiny", ttl_s=60)
        declared = http.post("/v1/completions", json=ASK, headers=SHORT)
    assert declared.status_code == 504
    assert declared.json()["error"]["message"] == (
        "The request did not finish within its deadline of 1 s: no engine that takes new "
        "requests (normal or prompt) was live for 'tiny' at the deadline, and none took it "
        "from the queue"
    )


def test_a_prompt_engine_alone_answers_the_first_token_then_a_deadline_naming_the_decoder(
    start_gateway, engines, redis_client, keys
):
    engines("prompt")  # a real one: it prefills and sends the first token
    gateway = start_gateway(models_cache_s=0.0)
    # Greedy: a sampled first token may be part of a character, whose text (and chunk)
    # waits for the next token, which no decoder makes here.
    body = {**ASK, "max_tokens": 8, "stream": True, "temperature": 0}
    with gateway.http() as http:
        assert http.post("/v1/completions", json=body).status_code == 503  # undeclared
        catalog.declare(redis_client, keys, "tiny", "test/tiny", ttl_s=60)
        with http.stream("POST", "/v1/completions", json=body, headers=SHORT) as reply:
            assert reply.status_code == 200  # the first token came
            chunks = [json.loads(x[6:]) for x in reply.iter_lines() if x.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"]
    assert chunks[-1]["error"]["code"] == "deadline_exceeded"
    assert chunks[-1]["error"]["message"] == (
        "The request did not finish within its deadline of 1 s: a prompt engine started it, "
        "but no decode (completion) engine was live for 'tiny' at the deadline to finish it"
    )
    # Counted as the 504 it is, though its response began 200: a decoder failing every
    # stream after its first token raised no alert on failed requests.
    route = {"route": "/v1/completions", "model": "tiny"}
    # Counted as its response ends, which the client may see first.
    assert eventually(
        lambda: gateway.metric("tandem_gateway_requests_total", status="504", **route) == 1
    )
    assert gateway.metric("tandem_gateway_requests_total", status="200", **route) == 0


def test_engine_series_stay_at_zero_once_the_engines_are_gone(start_gateway, redis_url, keys):
    conn = _register(redis_url, keys, "prompt", "completion")
    gateway = start_gateway(models_cache_s=0.0)

    def engines_scraped() -> dict[str, float]:
        with gateway.http() as http:
            text = http.get("/metrics").text
        prefix = 'tandem_gateway_engines{model="tiny",role="'
        return {
            line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(prefix)
        }

    assert engines_scraped() == {"normal": 0, "prompt": 1, "completion": 1}
    conn.delete(keys.engine_key("prompt-0"), keys.engine_key("completion-1"))
    # Neither live nor declared: no data would read as "no problem" to an alert.
    assert engines_scraped() == {"normal": 0, "prompt": 0, "completion": 0}


def test_a_deadline_an_engine_saw_first_is_answered_as_the_gateways_own(start_gateway, engines):
    # The engine ends a request at its deadline while the gateway waits a grace for it:
    # most often its error came first, and the 504 lacked x-should-retry: false (the
    # SDKs ran the request twice more, each time to its deadline) and the cause.
    engines("normal", "--max-model-len", "2048", "--num-kv-blocks", "256")
    gateway = start_gateway(models_cache_s=0.0)
    long = {**ASK, "max_tokens": 2000, "ignore_eos": True}
    with gateway.http() as http:
        answers = [http.post("/v1/completions", json=long, headers=SHORT) for _ in range(3)]
    for answer in answers:
        assert answer.status_code == 504, answer.text
        assert answer.headers["x-should-retry"] == "false"
        assert answer.json()["error"]["code"] == "deadline_exceeded"
        message = answer.json()["error"]["message"]
        assert message.startswith("The request did not finish within its deadline of 1 s")


def test_what_can_never_fit_the_context_is_refused_before_it_is_queued(
    start_gateway, redis_url, redis_client, keys
):
    # Engines refused it only as they took it from the queue: after minutes, under
    # load. Here no engine takes anything: the refusals are the gateway's own.
    conn = redis.Redis.from_url(redis_url)
    registry = Registry(conn, keys, ttl_seconds=600)
    registry.heartbeat(EngineInfo("n-0", "tiny", "normal", "127.0.0.1:1", max_model_len=256))
    gateway = start_gateway(models_cache_s=0.0)
    asks = {
        "prompt_too_long": ({**ASK, "prompt": [1] * 256}, "prompt"),
        "context_length_exceeded": ({**ASK, "prompt": [1] * 200, "max_tokens": 57}, "prompt"),
        "completion alone": ({**ASK, "max_tokens": 256}, "max_tokens"),
    }
    with gateway.http() as http:
        for body, param in asks.values():
            answer = http.post("/v1/completions", json=body, headers=SHORT)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == param
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
        answer = http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 300})
        assert answer.json()["error"]["param"] == "max_completion_tokens"
        assert answer.json()["error"]["message"] == (
            "This model's maximum context length is 256 tokens. However, you requested 300 "
            "tokens in the completion alone, which leaves no room for the prompt. Please "
            "reduce max_completion_tokens."
        )
        # What may fit is queued (and waits here for an engine that never comes).
        fits = http.post("/v1/completions", json={**ASK, "prompt": [1] * 200, "max_tokens": 56},
                         headers=SHORT)  # fmt: skip
        assert fits.status_code == 504  # queued: not refused, its deadline passed

    # An engine from before the field says nothing: nothing is checked.
    registry.heartbeat(EngineInfo("n-1", "tiny", "normal", "127.0.0.1:1"))
    gateway = start_gateway(models_cache_s=0.0)
    with gateway.http() as http:
        late = http.post("/v1/completions", json={**ASK, "max_tokens": 256}, headers=SHORT)
    assert late.status_code == 504


def _beside_an_older_engine(start_gateway, redis_url, keys):
    """(a Redis client, the registry, a gateway) with one engine of "tiny" registered
    as one from before chat options and cache_salt (it answers nothing)."""
    conn = redis.Redis.from_url(redis_url)
    registry = Registry(conn, keys, ttl_seconds=600)
    registry.heartbeat(EngineInfo("n-0", "tiny", "normal", "127.0.0.1:1"))
    return conn, registry, start_gateway(models_cache_s=0.0)


def test_chat_options_wait_for_engines_that_render_them(start_gateway, redis_url, keys):
    # An engine from before the options ignores them: the prompt would open a new
    # assistant turn where the client asked to go on with its own.
    conn, registry, gateway = _beside_an_older_engine(start_gateway, redis_url, keys)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    asks = {
        "add_generation_prompt": {"add_generation_prompt": False},
        "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    with gateway.http() as http:
        for param, option in asks.items():
            answer = http.post("/v1/chat/completions", json={**chat, **option}, headers=SHORT)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert (error["param"], error["code"]) == (param, "unsupported")
            assert "some engines of 'tiny' are older" in error["message"]
        # The defaults, spelled out, need nothing new.
        same = {**chat, "add_generation_prompt": True, "continue_final_message": False}
        assert http.post("/v1/chat/completions", json=same, headers=SHORT).status_code == 504
    registry.heartbeat(EngineInfo("n-0", "tiny", "normal", "127.0.0.1:1", chat_options=True))
    # A decoder renders no template (it takes the prompt's token ids): an older one is
    # no reason to refuse.
    registry.heartbeat(EngineInfo("c-0", "tiny", "completion", "127.0.0.1:1"))
    with gateway.http() as http:
        queued = http.post("/v1/chat/completions", json={**chat, **asks["add_generation_prompt"]},
                           headers=SHORT)  # fmt: skip
    assert queued.status_code == 504  # queued: no engine here takes work
    conn.close()


def test_a_salted_request_waits_for_engines_that_keep_the_salt(start_gateway, redis_url, keys):
    # An engine from before cache_salt reads the work item without it, and serves one
    # tenant's cached prompt to another: refused (503, to retry) while such runs.
    conn, registry, gateway = _beside_an_older_engine(start_gateway, redis_url, keys)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    with gateway.http() as http:
        salted = http.post("/v1/chat/completions", json={**chat, "cache_salt": "t"}, headers=SHORT)
        assert salted.status_code == 503, salted.text
        assert salted.json()["error"]["code"] == "engines_outdated"
        assert salted.headers["Retry-After"] == "30"
        assert http.post("/v1/chat/completions", json=chat, headers=SHORT).status_code == 504
    registry.heartbeat(EngineInfo("n-0", "tiny", "normal", "127.0.0.1:1", chat_options=True))
    with gateway.http() as http:
        queued = http.post("/v1/chat/completions", json={**chat, "cache_salt": "t"}, headers=SHORT)
    assert queued.status_code == 504  # queued: its deadline passed with no engine behind
    conn.close()


def test_a_request_without_max_tokens_is_charged_within_the_models_context(
    start_gateway, redis_url, keys, tmp_path
):
    # Charged the default max_tokens (1,024) on a model of 256 tokens: a key of 300
    # tokens a minute was refused (429 tpm_size) every request that set none.
    conn = redis.Redis.from_url(redis_url)
    registry = Registry(conn, keys, ttl_seconds=600)
    info = EngineInfo("n-0", "tiny", "normal", "127.0.0.1:1", max_model_len=256)
    registry.heartbeat(dataclasses.replace(info, chat_options=True))
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "sk-small", "name": "small", "tpm": 300}]))
    gateway = start_gateway(KeyStore.load(str(path), None), models_cache_s=0.0)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    with gateway.http() as http:
        headers = {**SHORT, "Authorization": "Bearer sk-small"}
        queued = http.post("/v1/chat/completions", json=ask, headers=headers)
    assert queued.status_code == 504, queued.text  # queued: no engine behind the entry


def test_a_whole_answer_goes_out_whatever_redis_takes_to_shorten_its_streams(
    start_gateway, engines
):
    # The call that shortens the answered streams' TTL had no bound of its own: a Redis
    # stalled at that moment (a fork, a slow fsync) held a whole answer 5 s.
    engines("normal")
    gateway = start_gateway(models_cache_s=0.0)

    async def stalled(request_ids: list[str]) -> None:
        await asyncio.sleep(4)

    gateway.app.state.gateway.broker.delivered = stalled
    with gateway.http() as http:
        started = time.monotonic()
        answer = http.post("/v1/completions", json=ASK)
        took = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert took < 3, took  # the answer, then at most a second's wait on Redis
