"""Bad requests: each gets the right status and an OpenAI error body, and the
gateway answers the next good request as if nothing happened."""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
import redis
from support.polling import eventually

from tandem.backlog import enqueue
from tandem.engine.service.cancellation import is_cancelled
from tandem.engine.service.registry import Registry
from tandem.gateway.auth import KeyStore
from tandem.protocol import WorkItem
from tandem.registry_entry import EngineInfo

from .live import API_KEY, LiveGateway, settings_for

USER = [{"role": "user", "content": "Hi"}]
GOOD = {"model": "tiny", "messages": USER, "max_tokens": 2, "temperature": 0}
# Models an engine is registered for that takes no work: requests to them wait.
FULL, SLOW, SLOW_STREAM, SLOW_CANCEL = "ghost-full", "ghost-slow", "ghost-stream", "ghost-cancel"
KEYS = [
    {"key": API_KEY, "name": "main"},
    {"key": "sk-other-model", "name": "other", "models": ["other"]},
    {"key": "sk-rpm", "name": "rpm-1", "rpm": 1},
    {"key": "sk-tpm", "name": "tpm-100", "tpm": 100},
    *({"key": f"sk-give-back-{i}", "name": f"give-back-{i}", "rpm": 2, "tpm": 100} for i in (0, 1)),
    *({"key": f"sk-settle-{i}", "name": f"settle-{i}", "tpm": 200} for i in range(4)),
    *(
        {"key": f"sk-in-flight{b}", "name": f"in-flight-1{b}", "max_in_flight": 1}
        for b in ("", "-b")
    ),
    *({"key": f"sk-usage-{i}", "name": f"usage-{i}"} for i in (0, 1)),
    {"key": "sk-paced", "name": "paced", "rpm": 3, "tpm": 10_000},
]


@pytest.fixture(scope="module")
def gateway(redis_server, shared_keys, shared_engine, tmp_path_factory):
    conn = redis.Redis.from_url(redis_server.url)
    registry = Registry(conn, shared_keys, ttl_seconds=600)
    for model in (FULL, SLOW, SLOW_STREAM, SLOW_CANCEL):
        registry.heartbeat(EngineInfo(f"ghost-{model}", model, "normal", "127.0.0.1:1"))
    enqueue(conn, shared_keys, WorkItem("queued-first", FULL, prompt="x"))
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    settings = settings_for(
        redis_server.url, shared_keys, max_queue=1, max_body_bytes=4096, body_timeout_s=1.0
    )
    live = LiveGateway(settings, KeyStore.load(str(path), None)).start()
    yield live, conn
    live.stop()
    conn.close()


@dataclass
class Case:
    status: int
    body: dict | bytes | None = None
    key: str | None = API_KEY
    headers: dict[str, str] = field(default_factory=dict)
    path: str = "/v1/chat/completions"
    method: str = "POST"
    # Sent first with the same key (to use up a quota).
    before: dict | None = None
    param: str | None = None
    code: str | None = None
    type: str | None = None
    message: str = ""
    check: Callable[[httpx.Response], None] | None = None

    def send(self, client: httpx.Client) -> httpx.Response:
        headers = {"Content-Type": "application/json", **self.headers}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        if self.before is not None:
            client.post(self.path, json=self.before, headers=headers).raise_for_status()
        content = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        return client.request(self.method, self.path, content=content, headers=headers)


def _retry_after(response: httpx.Response) -> None:
    assert int(response.headers["Retry-After"]) >= 1


def _no_retry(response: httpx.Response) -> None:
    assert response.headers["x-should-retry"] == "false"


def _no_empty_model(response: httpx.Response) -> None:
    # Not "The model '' does not exist": no model was named.
    error = response.json()["error"]
    assert "''" not in error["message"] and error["param"] is None and error["code"] is None


CASES = {
    "malformed json": Case(
        400,
        b'{"model": "tiny", "messages": [',
        message="not valid JSON: Expecting value (character 31)",
    ),
    "unterminated string": Case(
        400,
        b'{"model": "ti',
        message="not valid JSON: Unterminated string starting at (character 10)",
    ),
    "not an object": Case(400, b"[1, 2]", message="JSON object"),
    "wrong type": Case(400, {**GOOD, "temperature": "hot"}, param="temperature"),
    "wrong nested type": Case(400, {**GOOD, "messages": [{"role": "robot"}]},
                              param="messages[0].role"),
    "missing messages": Case(400, {"model": "tiny"}, param="messages", message="Missing"),
    "missing model": Case(400, {"messages": USER}, param="model"),
    "empty messages": Case(400, {**GOOD, "messages": []}, param="messages"),
    "unknown argument": Case(400, {**GOOD, "max_tokenz": 3}, param="max_tokenz",
                             message="Unrecognized request argument"),
    "max_tokens 0": Case(400, {**GOOD, "max_tokens": 0}, param="max_tokens"),
    "top_p below 0": Case(400, {**GOOD, "top_p": -0.1}, param="top_p"),
    "empty stop": Case(400, {**GOOD, "stop": [""]}, param="stop[0]"),
    "n too big": Case(400, {**GOOD, "n": 99}, param="n"),
    "top_logprobs without logprobs": Case(400, {**GOOD, "top_logprobs": 2},
                                          param="top_logprobs", message="logprobs is true"),
    "tools": Case(400, {**GOOD, "tools": [{"type": "function"}]}, param="tools",
                  code="unsupported", message="not supported"),
    "presence penalty over 2": Case(400, {**GOOD, "presence_penalty": 2.5},
                                    param="presence_penalty"),
    "stream_options without stream": Case(400, {**GOOD, "stream_options": {}},
                                          param="stream_options"),
    "image part": Case(400, {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        param="messages[0].content[0]"),
    "an empty prompt in a batch": Case(400, {"model": "tiny", "prompt": ["a", ""]},
                                       path="/v1/completions", param="prompt",
                                       message="prompt[1] must not be empty"),
    "a batch of too many work items": Case(400, {"model": "tiny", "prompt": ["a"] * 65, "n": 2},
                                           path="/v1/completions", param="prompt",
                                           message="65 prompts x n=2 make 130"),
    "empty prompt": Case(400, {"model": "tiny", "prompt": ""}, path="/v1/completions",
                         param="prompt"),
    "negative token id": Case(400, {"model": "tiny", "prompt": [1, -5]},
                              path="/v1/completions", param="prompt[1]"),
    "token id outside the vocabulary": Case(400, {"model": "tiny", "prompt": [1, 99999]},
                                            path="/v1/completions", param="prompt",
                                            code="invalid_request",
                                            message="outside the vocabulary"),
    "five stop sequences": Case(400, {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, param="stop",
                                message="at most 4 items are allowed, got 5"),
    "five stop sequences, completions": Case(400, {"model": "tiny", "prompt": "x",
                                                   "stop": list("abcde")},
                                             path="/v1/completions", param="stop",
                                             message="at most 4"),
    "unknown field in a message": Case(400, {**GOOD, "messages": [
        {"role": "user", "content": "Hi", "foo": 1}]}, param="messages[0].foo",
        message="Unrecognized request argument supplied: messages[0].foo"),
    "unknown field in a text part": Case(400, {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {}}]}]},
        param="messages[0].content[0].cache_control", message="Unrecognized"),
    "tool calls in a message": Case(400, {**GOOD, "messages": [*USER, {
        "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": "{}"}}]}, *USER]},
        param="messages[1].tool_calls", code="unsupported",
        message="tool calls are not supported"),
    "function call in a message": Case(400, {**GOOD, "messages": [*USER, {
        "role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}, *USER]},
        param="messages[1].function_call", code="unsupported",
        message="function calls are not supported"),
    "audio in a message": Case(400, {**GOOD, "messages": [*USER, {
        "role": "assistant", "audio": {"id": "audio_1"}}, *USER]},
        param="messages[1].audio", code="unsupported", message="audio is not supported"),
    "refusal in a message": Case(400, {**GOOD, "messages": [*USER, {
        "role": "assistant", "content": None, "refusal": "I can't."}, *USER]},
        param="messages[1].refusal", code="unsupported", message="refusals are not supported"),
    "an assistant message with nothing in it": Case(400, {**GOOD, "messages": [*USER, {
        "role": "assistant", "content": None}, *USER]},
        param="messages[1].content", message="messages[1].content is missing"),
    "best_of below n": Case(400, {"model": "tiny", "prompt": "x", "n": 2, "best_of": 1},
                            path="/v1/completions", param="best_of",
                            message="best_of (1) must be at least n (2)"),
    "a tool message": Case(400, {**GOOD, "messages": [*USER, {
        "role": "tool", "content": "42", "tool_call_id": "call_1"}]},
        param="messages[1].role", code="unsupported", message="tool calls are not supported"),
    "tool_call_id in a user message": Case(400, {**GOOD, "messages": [
        {"role": "user", "content": "Hi", "tool_call_id": "call_1"}]},
        param="messages[0].tool_call_id", message="only allowed in tool messages"),
    "refusal in a user message": Case(400, {**GOOD, "messages": [
        {"role": "user", "content": "Hi", "refusal": "no"}]},
        param="messages[0].refusal", message="only allowed in assistant messages"),
    "bad timeout header": Case(400, GOOD, headers={"X-Tandem-Timeout": "soon"},
                               param="X-Tandem-Timeout"),
    "bad priority header": Case(400, GOOD, headers={"X-Tandem-Priority": "urgent"},
                                param="X-Tandem-Priority"),
    "unknown model": Case(404, {**GOOD, "model": "nope"}, param="model",
                          code="model_not_found", message=", tiny (GET /v1/models)"),
    "prompt too long": Case(
        400, {**GOOD, "messages": [{"role": "user", "content": "lorem ipsum " * 150}]},
        param="messages", code="context_length_exceeded",
        message="maximum context length is 256 tokens. However, the prompt has",
    ),
    "max_tokens past the context": Case(
        400, {**GOOD, "max_tokens": 250, "messages": [{"role": "user", "content": "Hi " * 20}]},
        param="messages", code="context_length_exceeded",
        message="maximum context length is 256 tokens",
    ),
    "no key": Case(401, GOOD, key=None, code="missing_api_key"),
    "no key to list models": Case(401, None, key=None, path="/v1/models", method="GET",
                                  code="missing_api_key"),
    "wrong key to read a model": Case(401, None, key="sk-wrong", path="/v1/models/tiny",
                                      method="GET", code="invalid_api_key"),
    "wrong key": Case(401, GOOD, key="sk-wrong", code="invalid_api_key"),
    "key not allowed the model": Case(403, GOOD, key="sk-other-model", param="model",
                                      code="model_not_allowed"),
    # Not 404: a key limited to some models learns nothing of which others exist.
    "model nobody serves, key for another": Case(403, {**GOOD, "model": "nope"},
                                                 key="sk-other-model", param="model",
                                                 code="model_not_allowed"),
    # "no model is served now" read as the whole platform down, tiny served.
    "a model the key may use, not served": Case(
        404, {**GOOD, "model": "other"}, key="sk-other-model", param="model",
        code="model_not_found", message="; none of the models this key may use is served now",
    ),
    "oversized body": Case(413, {**GOOD, "user": "x" * 5000}, code="request_too_large"),
    "queue full": Case(429, {**GOOD, "model": FULL}, code="queue_full", check=_retry_after),
    "requests per minute": Case(429, GOOD, key="sk-rpm", before=GOOD, type="requests",
                                code="rate_limit_exceeded",
                                message="requests per minute", check=_retry_after),
    "tokens per minute": Case(429, {**GOOD, "max_tokens": 60}, key="sk-tpm",
                              before={**GOOD, "max_tokens": 60}, type="tokens",
                              code="rate_limit_exceeded",
                              message="tokens per minute", check=_retry_after),
    "larger than the tpm quota": Case(429, {**GOOD, "max_tokens": 150}, key="sk-tpm",
                                      code="rate_limit_exceeded", type="tokens",
                                      check=_no_retry,
                                      message="; lower max_tokens or n, or shorten the prompt"),
    # Not "lower max_tokens": the client never set it.
    "larger than the tpm quota by default": Case(
        429, {"model": "tiny", "messages": USER}, key="sk-tpm", code="rate_limit_exceeded",
        check=_no_retry, message="max_tokens, unset: 247, the default within the context, "
        "per choice), the limit is 100/min; set max_tokens lower, or n, or shorten"),
    "deadline passed": Case(504, {**GOOD, "model": SLOW}, headers={"X-Tandem-Timeout": "0.3"},
                            code="deadline_exceeded", check=_no_retry),
    "deadline passed, streaming": Case(504, {**GOOD, "model": SLOW_STREAM, "stream": True},
                                       headers={"X-Tandem-Timeout": "0.3"},
                                       code="deadline_exceeded"),
    "string for a number": Case(400, {**GOOD, "max_tokens": "2"}, param="max_tokens"),
    "boolean for a number": Case(400, {**GOOD, "temperature": True}, param="temperature"),
    "decimal for an integer": Case(400, {**GOOD, "n": 1.0}, param="n"),
    "string for a boolean": Case(400, {**GOOD, "stream": "yes"}, param="stream"),
    "NaN temperature": Case(400, json.dumps({**GOOD, "temperature": float("nan")}).encode(),
                            param="temperature", message="finite"),
    "seed beyond int64": Case(400, {**GOOD, "seed": 2**64}, param="seed"),
    "lone surrogate": Case(400, {**GOOD, "messages": [{"role": "user", "content": "\ud800x"}]},
                           param="messages[0].content", message="lone surrogate (U+D800)"),
    "lone surrogate in a prompt": Case(400, {"model": "tiny", "prompt": "a\udfff"},
                                       path="/v1/completions", param="prompt",
                                       message="lone surrogate"),
    "text part without text": Case(400, {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, param="messages[0].content[0].text", message="Missing"),
    "empty stop string": Case(400, {**GOOD, "stop": ""}, param="stop"),
    "invalid UTF-8": Case(400, b'{"model": "tiny", "user": "\xff\xfe"}',
                          message="not valid UTF-8"),
    # Read as it came, a compressed body was "not valid UTF-8".
    "gzip body": Case(415, gzip.compress(json.dumps(GOOD).encode()),
                      headers={"Content-Encoding": "gzip"}, code="unsupported_media_type",
                      message="Content-Encoding gzip is not supported"),
    "nested too deeply": Case(400, b"[" * 1500 + b"]" * 1500, message="too deeply"),
    # A JSON object sent as text/plain was told the body must be a JSON object.
    "JSON sent as text/plain": Case(400, GOOD, headers={"Content-Type": "text/plain"},
                                    message="Content-Type is 'text/plain', not read as JSON"),
    "trailing slash": Case(404, GOOD, path="/v1/chat/completions/"),
    "trailing slash on models": Case(404, None, path="/v1/models/", method="GET",
                                     check=_no_empty_model),
    "logit_bias token id outside the vocabulary": Case(400, {**GOOD, "logit_bias": {"99999": 1}},
                                                       param="logit_bias", code="invalid_request",
                                                       message="outside the vocabulary"),
    "messages sent to completions": Case(400, {"model": "tiny", "messages": USER},
                                         path="/v1/completions", param="messages",
                                         message="send messages to /v1/chat/completions"),
    "prompt sent to chat": Case(400, {"model": "tiny", "prompt": "Hi"}, param="prompt",
                                message="send a prompt to /v1/completions"),
    "stop neither a string nor a list": Case(400, {**GOOD, "stop": 5}, param="stop",
                                             message="stop must be a string or a list of strings"),
    "service tier other than auto": Case(400, {**GOOD, "service_tier": "flex"},
                                         param="service_tier", code="unsupported"),
    "reasoning effort": Case(400, {**GOOD, "reasoning_effort": "high"},
                             param="reasoning_effort", code="unsupported"),
    "unknown route": Case(404, GOOD, path="/v1/embeddings",
                          message="Invalid URL (POST /v1/embeddings): this server answers POST "
                                  "/v1/chat/completions"),
    "wrong method": Case(405, None, path="/v1/chat/completions", method="GET",
                         message="Method GET is not allowed for /v1/chat/completions; use POST"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_request_gets_an_openai_error_and_the_gateway_keeps_serving(gateway, name):
    live, _ = gateway
    case = CASES[name]
    with httpx.Client(base_url=live.url, timeout=30) as client:
        response = case.send(client)
        assert response.status_code == case.status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"]
        if case.param is not None:
            assert error["param"] == case.param
        if case.code is not None:
            assert error["code"] == case.code
        if case.type is not None:
            assert error["type"] == case.type
        assert case.message in error["message"]
        if case.check is not None:
            case.check(response)
        good = client.post("/v1/chat/completions", json=GOOD, headers=_auth(API_KEY))
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_an_integer_too_long_to_read_is_named(shared_gateway):
    # Python refuses int literals over 4,300 digits; the body is over the test
    # gateway's 4 KiB limit, so the shared one (1 MiB) reads it.
    body = json.dumps(GOOD)[:-1].encode() + b', "seed": 1' + b"0" * 5000 + b"}"
    with shared_gateway.http() as client:
        response = client.post(
            "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "a number in it is too long (more than 4300 digits)" in message
    assert "set_int_max_str_digits" not in message  # advice for the server, not the client


def test_prompt_too_long_names_both_lengths(gateway):
    live, _ = gateway
    first_tokens = live.metric("tandem_gateway_enqueue_to_first_token_seconds_count")
    with live.http() as client:
        body = {**GOOD, "messages": [{"role": "user", "content": "lorem ipsum " * 150}]}
        message = client.post("/v1/chat/completions", json=body).json()["error"]["message"]
    assert "has " in message and " tokens, more than the 255 that leave room" in message
    # The engine's refusal is no first token: not timed as one.
    assert live.metric("tandem_gateway_enqueue_to_first_token_seconds_count") == first_tokens


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**GOOD, "messages": [{"role": "user", "content": "ab " * 300}]}),
        ("/v1/completions", {"model": "tiny", "prompt": [1] * 300}),
    ],
)
def test_prompt_too_long_says_what_to_do_without_internal_ids(gateway, path, body):
    # The engine's request id is the gateway's uuid: the client never saw it, and
    # it made every such message different.
    live, _ = gateway
    with live.http() as client:
        error = client.post(path, json=body).json()["error"]
    # OpenAI's code for any overflow: clients catch it by that to cut the prompt.
    assert error["code"] == "context_length_exceeded"
    assert not re.search(r"[0-9a-f]{32}|request", error["message"]), error["message"]
    if path == "/v1/completions":
        assert "300 tokens" in error["message"]
    assert "the 255 that" in error["message"] and "Please reduce" in error["message"]


def test_four_stop_sequences_and_every_openai_message_field_pass(gateway):
    # Fields OpenAI's message schemas define, at the values a client that sends
    # every field (or appends OpenAI's own reply) uses where they do not apply.
    messages = [
        {"role": "developer", "content": "Be terse.", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": "ann"},
        {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [],
         "audio": None, "tool_calls": [], "function_call": None, "name": "bot"},
        {"role": "user", "content": "Again", "tool_call_id": None},
    ]  # fmt: skip
    live, _ = gateway
    with live.http() as client:
        body = {**GOOD, "messages": messages, "stop": ["a", "b", "c", "d"]}
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text


def test_a_deadline_cancels_the_queued_work(gateway, shared_keys):
    live, conn = gateway
    before = live.metric("tandem_gateway_cancellations_total", why="deadline")
    stream = shared_keys.work_stream(SLOW_CANCEL, 1)
    replies: list[httpx.Response] = []

    def ask() -> None:
        with live.http() as client:
            replies.append(
                client.post(
                    "/v1/completions",
                    json={"model": SLOW_CANCEL, "prompt": "x", "max_tokens": 3},
                    headers={"X-Tandem-Timeout": "1"},
                )
            )

    asking = threading.Thread(target=ask)
    asking.start()
    assert eventually(lambda: conn.xlen(stream) == 1)
    [(_, queued)] = conn.xrange(stream)
    work = WorkItem.from_fields(queued)
    assert work.deadline is not None and work.deadline - work.created_at == pytest.approx(1)
    asking.join(30)
    assert replies[0].status_code == 504
    assert live.metric("tandem_gateway_cancellations_total", why="deadline") == before + 1
    assert is_cancelled(conn, shared_keys, work.request_id)
    assert conn.xlen(stream) == 0  # no engine had read it: taken back out of the queue


def test_rejections_are_counted_by_reason(gateway):
    live, _ = gateway

    def counts() -> tuple[float, float, float]:
        return (
            live.metric("tandem_gateway_rejections_total", reason="auth"),
            live.metric("tandem_gateway_rejections_total", reason="queue_full"),
            live.metric("tandem_gateway_requests_total", status="401"),
        )

    before = counts()
    latencies = live.metric("tandem_gateway_request_seconds_count")
    with live.http(api_key=None) as anonymous:
        assert anonymous.post("/v1/chat/completions", json=GOOD).status_code == 401
    with live.http() as client:
        assert client.post("/v1/chat/completions", json={**GOOD, "model": FULL}).status_code == 429
    assert eventually(lambda: counts() == (before[0] + 1, before[1] + 1, before[2] + 1))
    # Refusals are not latencies: quick 401s and 429s pulled the percentiles down as
    # an overload got worse.
    assert live.metric("tandem_gateway_request_seconds_count") == latencies


def test_a_request_refused_before_its_model_is_looked_up_is_labelled_unknown(gateway):
    live, _ = gateway
    labels = {"route": "/v1/chat/completions", "status": "400"}
    before = live.metric("tandem_gateway_requests_total", model="unknown", **labels)
    with live.http() as client:
        assert client.post("/v1/chat/completions", json={**GOOD, "n": 1.5}).status_code == 400
    assert eventually(
        lambda: (
            live.metric("tandem_gateway_requests_total", model="unknown", **labels) == before + 1
        )
    )
    assert live.metric("tandem_gateway_requests_total", model="") == 0


def _partial_body(live: LiveGateway, key: str | None = API_KEY) -> socket.socket:
    """A connection that sent a request's headers and 8 of the 100 bytes it declared."""
    conn = socket.create_connection(("127.0.0.1", live.settings.port), timeout=10)
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    conn.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n" + auth
        + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"model"'
    )  # fmt: skip
    return conn


def test_a_stranger_is_refused_before_the_body_is_read(gateway):
    # A megabyte each, held for the body timeout, before the key was checked: a
    # stranger's few hundred connections took the gateway's memory.
    live, _ = gateway
    reply = b""
    with _partial_body(live, key=None) as conn:  # the body never whole: 408 if it waited
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401")


def test_a_body_that_does_not_arrive_in_time_gets_408(gateway):
    # A body sent slowly or never held its connection, and the bytes already sent,
    # for as long as the client wished.
    live, _ = gateway
    before = live.metric("tandem_gateway_rejections_total", reason="body_timeout")
    reply = b""
    with _partial_body(live) as conn:  # answered after 1 s, within the socket's 10 s
        while chunk := conn.recv(65536):  # to the close: the rest of the body is unread
            reply += chunk
    head, _, body = reply.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 408")
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout"
    assert error["message"] == "The request body did not arrive within 1 s"
    assert live.metric("tandem_gateway_rejections_total", reason="body_timeout") == before + 1


def test_a_client_gone_before_its_body_was_whole_is_counted_as_gone_not_500(gateway):
    live, _ = gateway
    before = {s: live.metric("tandem_gateway_requests_total", status=s) for s in ("499", "500")}
    _partial_body(live).close()
    assert eventually(lambda: live.metric("tandem_gateway_requests_total", status="499") > 0)
    assert live.metric("tandem_gateway_requests_total", status="499") == before["499"] + 1
    assert live.metric("tandem_gateway_requests_total", status="500") == before["500"]


def test_an_idempotency_key_takes_a_lone_surrogate_in_a_field_never_read(gateway):
    # JavaScript's JSON.stringify sends a cut emoji as "\ud83d": the request digest
    # could not encode it, a 500 the SDKs retried twice. Without the key it served.
    live, _ = gateway
    body = json.dumps({**GOOD, "model": "tiny", "user": "\ud83d", "max_tokens": 1})
    headers = {**_auth(API_KEY), "Content-Type": "application/json", "Idempotency-Key": "js-1"}
    with live.http() as client:
        reply = client.post("/v1/chat/completions", content=body, headers=headers)
    assert reply.status_code == 200, reply.text


def test_an_idempotency_key_on_a_request_nested_too_deep_to_compare_is_a_400(gateway):
    # Pydantic serialises 255 levels; the digest of a deeper field the engine never
    # reads (an assistant message's annotations) was a 500.
    live, _ = gateway
    deep: list = []
    for _ in range(300):
        deep = [deep]
    message = {"role": "assistant", "content": "Hi", "annotations": [{"a": deep}]}
    body = json.dumps({**GOOD, "messages": [*USER, message, *USER], "max_tokens": 1})
    headers = {**_auth(API_KEY), "Content-Type": "application/json", "Idempotency-Key": "deep"}
    with live.http() as client:
        reply = client.post("/v1/chat/completions", content=body, headers=headers)
    assert reply.status_code == 400, reply.text
    assert "nested too deeply" in reply.json()["error"]["message"]


def test_two_authorization_headers_are_refused_whichever_comes_first(gateway):
    live, _ = gateway
    for keys in ((API_KEY, "sk-wrong"), ("sk-wrong", API_KEY)):
        headers = [("Authorization", f"Bearer {key}") for key in keys]
        with live.http(api_key=None) as client:
            reply = client.post("/v1/chat/completions", json=GOOD, headers=httpx.Headers(headers))
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"]["message"].startswith("2 Authorization headers: send one")


def test_an_open_gateway_takes_requests_with_several_authorization_headers(start_gateway):
    # --no-auth takes every request: behind a proxy that adds its own header too.
    live = start_gateway(no_auth=True)
    headers = httpx.Headers([("Authorization", "Bearer a"), ("Authorization", "Bearer b")])
    with live.http(api_key=None) as client:
        assert client.get("/v1/models", headers=headers).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_refuses_uses_no_tokens_but_its_request(gateway, stream):
    # Charged at admission, an engine's 400 (a token id outside the vocabulary, a
    # context too long) kept its tokens: a typo in max_tokens took most of a minute's
    # tokens, and the next good request got a 429. Its request stays counted: given
    # back too, a key's rpm let any number of too-long prompts through the engines.
    live, _ = gateway
    refused = {"model": "tiny", "prompt": [1, 99999], "max_tokens": 60, "stream": stream}
    with live.http(api_key=f"sk-give-back-{int(stream)}") as client:
        first = client.post("/v1/completions", json=refused)
        assert first.status_code == 400 and "outside the vocabulary" in first.text
        good = client.post("/v1/completions", json={**refused, "prompt": [1, 2]})
        assert good.status_code == 200, good.text  # 62 of 100 tokens: the 62 came back
        again = client.post("/v1/completions", json={**refused, "prompt": [1, 2]})
        assert again.status_code == 429  # rpm 2: the refused request and the good one
        assert again.json()["error"]["type"] == "requests"


def _usage(client: httpx.Client, ask: dict) -> dict:
    """The usage of one answered completion, streamed or not."""
    if not ask.get("stream"):
        reply = client.post("/v1/completions", json=ask)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]
    ask = {**ask, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=ask) as reply:
        assert reply.status_code == 200, reply.read()
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: {")]
    return json.loads(events[-1])["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_token_quota_charges_what_the_answer_used(gateway, stream):
    # Charged an estimate at admission and never settled, text the tokenizer cuts finer
    # than the estimate (CJK on this byte-level one) ran at many times a key's tpm.
    live, _ = gateway
    cjk = {"model": "tiny", "prompt": "漢字" * 20, "max_tokens": 4, "stream": stream}
    with live.http(api_key=f"sk-settle-{int(stream)}") as client:
        usage = _usage(client, cjk)  # charged 120 UTF-8 bytes / 4 + 4 = 34
        assert usage["prompt_tokens"] > 60
        # Room for 166 after the estimate, 200 - total_tokens (< 136) after the usage.
        later = client.post("/v1/completions", json={**cjk, "prompt": [1, 2], "max_tokens": 150})
    assert later.status_code == 429, later.text
    assert later.json()["error"]["type"] == "tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_the_token_quota_gives_back_what_the_answer_did_not_use(gateway, stream):
    # n=2 is charged the prompt twice and max_tokens twice; usage counts the prompt once.
    live, _ = gateway
    ask = {"model": "tiny", "prompt": list(range(1, 51)), "max_tokens": 2, "n": 2}
    with live.http(api_key=f"sk-settle-{2 + int(stream)}") as client:
        usage = _usage(client, {**ask, "stream": stream})  # charged 2 x 52 = 104
        assert usage["total_tokens"] <= 54
        # 96 left after the estimate, at least 146 after the usage.
        later = {"model": "tiny", "prompt": [1, 2], "max_tokens": 130}
        reply = client.post("/v1/completions", json=later)
    assert reply.status_code == 200, later.text


@pytest.mark.parametrize("header", ["X-Tandem-Priority", "X-Tandem-Timeout", "Idempotency-Key"])
def test_a_job_header_sent_twice_is_refused(gateway, header):
    # Read by its first, a second one went unchecked: "high" then "bogus" passed.
    live, _ = gateway
    good = {"X-Tandem-Priority": "high", "X-Tandem-Timeout": "30", "Idempotency-Key": "k-1"}
    headers = httpx.Headers([(header, good[header]), (header, good[header])])
    with live.http() as client:
        reply = client.post("/v1/chat/completions", json=GOOD, headers=headers)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["message"] == f"{header} was sent 2 times: send it once"
    assert error["param"] == header


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_holds_at_most_max_in_flight_requests_being_answered(gateway):
    # One key with thousands in flight drained a replica's Redis pool: every other
    # key's requests failed. Its places come back however its requests end.
    live, conn = gateway
    slow = {**GOOD, "model": SLOW}
    held_places = live.app.state.gateway.admission.in_flight.set_key("in-flight-1")
    with live.http(api_key="sk-in-flight") as client:
        held = threading.Thread(
            target=client.post,
            args=("/v1/chat/completions",),
            kwargs={"json": slow, "headers": {"X-Tandem-Timeout": "2"}},
        )
        held.start()
        assert eventually(lambda: conn.zcard(held_places) == 1, timeout=5)
        replies: list[httpx.Response] = []
        assert eventually(lambda: _refused_in_flight(client, replies), timeout=5)
        refused = replies[-1]
        assert refused.headers["Retry-After"] == "1"
        assert "in flight for key 'in-flight-1'" in refused.json()["error"]["message"]
        with live.http() as other:  # other keys are not held back
            assert other.post("/v1/chat/completions", json=GOOD).status_code == 200
        held.join()  # answered at its deadline: its place comes back
        assert client.post("/v1/chat/completions", json=GOOD).status_code == 200
        assert client.post("/v1/chat/completions", json=GOOD).status_code == 200

        # A client that leaves gives its place back.
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=slow, timeout=0.5)
        assert eventually(
            lambda: client.post("/v1/chat/completions", json=GOOD).status_code == 200, timeout=5
        )
    assert live.metric("tandem_gateway_rejections_total", reason="in_flight_exceeded") >= 1
    # Which tenant was held back, by its key's name.
    by_key = {"key": "in-flight-1", "reason": "in_flight_exceeded"}
    assert live.metric("tandem_gateway_key_rejections_total", **by_key) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_each_keys_usage_is_counted_by_its_name(gateway, stream):
    live, _ = gateway
    key = f"usage-{int(stream)}"
    ask = {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "n": 2, "stream": stream}

    def used(kind: str) -> float:
        return live.metric("tandem_gateway_key_tokens_total", key=key, model="tiny", type=kind)

    with live.http(api_key=f"sk-{key}") as client:
        usage = _usage(client, ask)
        # Refused by the body limit, before any route: its key is known already.
        assert client.post("/v1/completions", json={**ask, "user": "x" * 5000}).status_code == 413
    assert used("prompt") == usage["prompt_tokens"] > 0
    assert used("completion") == usage["completion_tokens"] == 6
    refused = {"key": key, "reason": "too_large"}
    assert live.metric("tandem_gateway_key_rejections_total", **refused) == 1


def _refused_in_flight(client: httpx.Client, replies: list[httpx.Response]) -> bool:
    replies.append(reply := client.post("/v1/chat/completions", json=GOOD))
    if reply.status_code != 429:
        return False
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "in_flight")
    return True


def test_answers_carry_the_keys_rate_limit_headers(gateway):
    # OpenAI's x-ratelimit-*: clients pace themselves by what is left of the key's quotas.
    live, _ = gateway
    ask = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5}
    with live.http(api_key="sk-paced") as client:
        plain = client.post("/v1/completions", json=ask)
        with client.stream("POST", "/v1/completions", json={**ask, "stream": True}) as stream:
            streamed = stream.headers
            stream.read()
        with live.http() as unlimited:  # a key without quotas: no headers
            free = unlimited.post("/v1/completions", json=ask).headers
    assert plain.status_code == 200
    assert plain.headers["x-ratelimit-limit-requests"] == "3"
    assert plain.headers["x-ratelimit-remaining-requests"] == "2"
    assert plain.headers["x-ratelimit-reset-requests"] == "20s"  # 3 a minute: one in 20 s
    assert plain.headers["x-ratelimit-limit-tokens"] == "10000"
    assert int(plain.headers["x-ratelimit-remaining-tokens"]) == 10_000 - 8  # 3 + 5, charged
    assert streamed["x-ratelimit-remaining-requests"] == "1"  # a request is back in 20 s
    assert "x-ratelimit-limit-requests" not in free


def test_a_retry_attached_to_the_work_holds_its_place_when_the_first_attempt_leaves(gateway):
    # The first attempt's client left while a retry read on: its place came back with
    # the work still running, and a key could run any number of requests that way.
    live, conn = gateway
    slow = {**GOOD, "model": SLOW}
    places = live.app.state.gateway.admission.in_flight.set_key("in-flight-1-b")
    same = {"Idempotency-Key": "attach-me"}
    with live.http(api_key="sk-in-flight-b") as client:

        def attempt(timeout: float) -> None:
            with contextlib.suppress(httpx.ReadTimeout):
                client.post("/v1/chat/completions", json=slow, headers=same, timeout=timeout)

        first = threading.Thread(target=attempt, args=(1.5,))
        first.start()
        assert eventually(lambda: conn.zcard(places) == 1, timeout=5)
        retry = threading.Thread(target=attempt, args=(4.0,))
        retry.start()
        first.join()  # its client gone: the retry reads on, and holds the place
        time.sleep(0.5)
        assert conn.zcard(places) == 1
        assert client.post("/v1/chat/completions", json=GOOD).status_code == 429
        retry.join()  # the last reader gone: the work is cancelled, the place back
        assert eventually(lambda: conn.zcard(places) == 0, timeout=5)
        assert client.post("/v1/chat/completions", json=GOOD).status_code == 200


def test_an_engines_refusal_of_a_batch_names_its_prompt(gateway):
    live, _ = gateway
    batch = {"model": "tiny", "prompt": [[1, 2], [1, 99999]], "max_tokens": 2}
    with live.http() as client:
        refused = client.post("/v1/completions", json=batch)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "outside the vocabulary" in error["message"]
    assert error["message"].endswith("(prompt 1 of the batch)")
