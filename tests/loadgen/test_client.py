"""One request: what is sent, and how the stream and every kind of failure are recorded."""

import asyncio
import json
import time

import httpx
import pytest
import uvicorn

from tandem.loadgen.client import Target, described, send, sse_lines
from tandem.loadgen.record import RequestRecord

from .fake_server import FakeServer, sse

TARGET = Target(base_url="http://fake/v1", model="m", timeout_s=5.0)


def new_record(max_tokens=4):
    return RequestRecord(0, 0.0, 0.0, input_tokens=3, max_tokens=max_tokens)


def run(transport, target=TARGET, prompt=None, max_tokens=4):
    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(
                client, target, new_record(max_tokens), prompt or [1, 2, 3], time.perf_counter()
            )

    return asyncio.run(go())


def canned(*chunks: bytes, status=200):
    async def handle(request):
        return httpx.Response(status, content=b"".join(chunks))

    return httpx.MockTransport(handle)


def test_a_completion_stream_is_timed_and_counted():
    server = FakeServer(first_delay=0.05, token_delay=0.02)
    record = run(server.transport(), max_tokens=4)
    assert record.ok and record.status == 200 and record.finish_reason == "length"
    assert (record.output_tokens, record.prompt_tokens, record.usage_reported) == (4, 7, True)
    assert len(record.chunk_times_s) == 4
    assert 0.05 <= record.ttft_s < record.e2e_s
    # Three gaps of 20 ms after the first token.
    assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / 3)
    assert all(gap >= 0.019 for gap in record.chunk_gaps_s)
    body = server.bodies[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["model"] == "m"


def test_a_chat_role_chunk_is_not_the_first_token():
    server = FakeServer(first_delay=0.1)
    chat = Target(base_url="http://fake/v1", model="m", api="chat", ignore_eos=False)
    record = run(server.transport(), target=chat, prompt="hi")
    assert record.ok and record.ttft_s >= 0.1
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert "ignore_eos" not in server.bodies[0]


def test_without_usage_the_output_is_counted_in_chunks():
    record = run(FakeServer(usage=False).transport(), max_tokens=3)
    assert record.ok and (record.output_tokens, record.usage_reported) == (3, False)
    assert record.prompt_tokens is None


def test_an_http_error_keeps_its_status_and_the_servers_message():
    body = b'{"error": {"message": "Queue full", "type": "x", "param": null, "code": "queue_full"}}'
    record = run(canned(body, status=429))
    assert (record.status, record.error_kind, record.error_message) == (
        429,
        "http_429",
        "Queue full",
    )
    assert record.ttft_s is None and record.e2e_s is not None and not record.ok


def test_an_error_event_in_the_stream():
    error = {"error": {"message": "engine died", "type": "server_error"}}
    record = run(canned(sse({"choices": [{"text": "a"}]}), sse(error)))
    assert (record.status, record.error_kind, record.error_message) == (
        200,
        "stream_error",
        "engine died",
    )
    assert record.ttft_s is not None


def test_a_stream_that_ends_without_finishing_is_a_protocol_error():
    record = run(canned(sse({"choices": [{"text": "a", "finish_reason": None}]})))
    assert record.error_kind == "protocol" and "finish_reason" in record.error_message
    record = run(canned(b"data: {oops\n\n"))
    assert record.error_kind == "protocol" and "unreadable" in record.error_message


def test_an_answer_that_is_no_event_stream_says_so():
    # A server that ignores stream: true answers JSON: every request read as "the
    # stream ended without a finish_reason", which named nothing.
    whole = json.dumps({"choices": [{"text": "a", "finish_reason": "length"}]}).encode()
    record = run(canned(whole))
    assert record.error_kind == "protocol"
    assert record.error_message.startswith("the server sent no event stream")


def test_a_refused_connection():
    def refuse(request):
        raise httpx.ConnectError("connection refused")

    record = run(httpx.MockTransport(refuse))
    assert (record.status, record.error_kind) == (None, "connection")
    assert "connection refused" in record.error_message


def test_a_request_over_its_timeout():
    slow = Target(base_url="http://fake/v1", model="m", timeout_s=0.1)
    record = run(FakeServer(first_delay=1.0).transport(), target=slow)
    assert record.error_kind == "timeout" and record.status == 200
    assert 0.1 <= record.e2e_s < 0.9


def test_an_error_without_words_is_still_described_on_one_line():
    # httpx's ReadError from a server that closed the connection (a 413 answered
    # before a huge body went out) has an empty message: the report read "ReadError:".
    assert described(httpx.ReadError("")) == (
        "ReadError: the server closed the connection, or it was cut"
    )
    assert described(httpx.ConnectTimeout("timed\nout")) == "ConnectTimeout: timed out"


def _sse_raw(obj) -> bytes:
    """As a server that writes JSON's text as is (pydantic: U+2028 and U+0085 raw)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def test_text_with_unicode_line_separators_is_one_sse_line():
    text = {"choices": [{"text": "a\u2028b\u0085c", "finish_reason": "length"}]}
    record = run(canned(_sse_raw(text), b"data: [DONE]\n\n"))
    assert record.ok, record.error_message
    assert len(record.chunk_times_s) == 1


def test_a_crlf_split_between_two_reads_ends_one_line():
    async def lines():
        class Split(httpx.AsyncByteStream):
            async def __aiter__(self):
                yield b'data: {"x": 1}\r'
                yield b"\n\r\ndata: [DONE]\r\n\r\n"

        response = httpx.Response(200, stream=Split())
        return [line async for line in sse_lines(response)]

    assert asyncio.run(lines()) == ['data: {"x": 1}', "", "data: [DONE]", ""]


@pytest.mark.parametrize(
    "chunk",
    [
        {"choices": [None]},
        {"choices": [{"text": 3}]},
        {
            "choices": [{"text": "a", "finish_reason": "length"}],
            "usage": {"completion_tokens": "3"},
        },
    ],
    ids=["null-choice", "number-text", "text-count"],
)
def test_a_chunk_of_the_wrong_shape_fails_its_request_not_the_run(chunk):
    record = run(canned(sse(chunk), b"data: [DONE]\n\n"))
    assert record.error_kind == "protocol" and not record.ok


def test_a_reasoning_models_thoughts_are_its_first_tokens():
    chat = Target(base_url="http://fake/v1", model="m", api="chat")
    thought = sse({"choices": [{"delta": {"reasoning_content": "hmm"}}]})
    said = sse({"choices": [{"delta": {"content": "4"}, "finish_reason": "stop"}]})
    record = run(canned(thought, said, b"data: [DONE]\n\n"), target=chat, prompt="2+2?")
    assert record.ok and len(record.chunk_times_s) == 2
    assert record.ttft_s <= record.chunk_times_s[0]


def test_requests_reuse_one_connection(unused_tcp_port):
    # The stream was left at [DONE], before the body's end: httpx closed the connection,
    # and every request's TTFT timed a new connection's setup (a TLS handshake too).
    ports: list[int] = []

    async def app(scope, receive, send_):
        if scope["type"] != "http":
            return
        ports.append(scope["client"][1])
        await send_({"type": "http.response.start", "status": 200,
                     "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        done = {"choices": [{"text": "a", "finish_reason": "length"}]}
        await send_({"type": "http.response.body", "body": sse(done), "more_body": True})
        await send_({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    config = uvicorn.Config(app, host="127.0.0.1", port=unused_tcp_port, log_level="error")
    server = uvicorn.Server(config)

    async def go():
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        target = Target(base_url=f"http://127.0.0.1:{unused_tcp_port}/v1", model="m")
        async with httpx.AsyncClient() as client:
            records = [
                await send(client, target, new_record(1), [1], time.perf_counter())
                for _ in range(3)
            ]
        server.should_exit = True
        await serving
        return records

    assert all(r.ok for r in asyncio.run(go()))
    assert len(ports) == 3 and len(set(ports)) == 1, f"client ports {ports}"


def test_an_answer_complete_at_done_stays_complete_whatever_the_body_does_after():
    chunk = sse({"choices": [{"text": "a", "finish_reason": "length"}]})

    class BrokenOff(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield chunk + b"data: [DONE]\n\n"
            raise httpx.RemoteProtocolError("incomplete chunked read")

    class KeptOpen(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield chunk + b"data: [DONE]\n\n"
            await asyncio.sleep(30)

    for body in (BrokenOff(), KeptOpen()):

        async def handle(request, body=body):
            return httpx.Response(200, stream=body)

        started = time.monotonic()
        record = run(httpx.MockTransport(handle))
        assert record.ok, record.error_message
        assert time.monotonic() - started < 5


def test_a_body_kept_open_past_done_near_the_deadline_is_no_timeout():
    # The request's deadline passed while the body's end was read after its [DONE]: a
    # whole answer, its latency taken below the deadline, was counted a timeout and
    # left out of every latency and goodput figure.
    chunk = sse({"choices": [{"text": "a", "finish_reason": "length"}]})

    class LateDone(httpx.AsyncByteStream):
        async def __aiter__(self):
            await asyncio.sleep(0.3)
            yield chunk + b"data: [DONE]\n\n"
            await asyncio.sleep(30)

    async def handle(request):
        return httpx.Response(200, stream=LateDone())

    soon = Target(base_url="http://fake/v1", model="m", timeout_s=0.6)
    record = run(httpx.MockTransport(handle), target=soon)
    assert record.ok, record.error_message
    assert record.finish_reason == "length" and 0.3 <= record.e2e_s < 0.6
