"""A started stream with nothing to send sends SSE comments: proxies with an idle
timeout cut a stream silent for as long (a decoder restarted mid-answer: ~35 s)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import tracemalloc

import redis
from support.polling import eventually

from tandem.engine.service.registry import Registry
from tandem.engine.service.responses import ResponseWriter
from tandem.gateway.streaming import KEEPALIVE, with_keepalive
from tandem.protocol import ResponseEvent, Usage
from tandem.registry_entry import EngineInfo

from .live import STAND_IN, take_queued


def test_chunks_pass_as_they_come_and_a_silence_is_filled_with_comments() -> None:
    async def main() -> tuple[list[bytes], list[str]]:
        log: list[str] = []

        async def chunks():
            try:
                yield b"data: a\n\n"
                await asyncio.sleep(0.35)
                yield b"data: b\n\n"
            finally:
                log.append("closed")

        return [chunk async for chunk in with_keepalive(chunks(), 0.1)], log

    got, log = asyncio.run(main())
    assert got[0] == b"data: a\n\n" and got[-1] == b"data: b\n\n"
    assert 2 <= got.count(KEEPALIVE) <= 4 and len(got) == got.count(KEEPALIVE) + 2
    assert log == ["closed"]


def test_closing_mid_wait_closes_the_source_and_an_error_passes_through() -> None:
    async def main() -> tuple[list[str], BaseException | None]:
        log: list[str] = []

        async def slow():
            try:
                yield b"data: a\n\n"
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                log.append("cancelled")
                raise
            finally:
                log.append("closed")

        stream = with_keepalive(slow(), 0.05)
        assert await anext(stream) == b"data: a\n\n"
        assert await anext(stream) == KEEPALIVE  # waiting on the source's sleep
        await stream.aclose()

        async def failing():
            yield b"data: a\n\n"
            raise RuntimeError("the source failed")

        try:
            [chunk async for chunk in with_keepalive(failing(), 1.0)]
        except RuntimeError as exc:
            return log, exc
        return log, None

    log, error = asyncio.run(main())
    assert log == ["cancelled", "closed"]
    assert str(error) == "the source failed"


def test_a_silent_started_stream_reaches_the_sdk_whole(start_gateway, redis_url, keys) -> None:
    conn = redis.Redis.from_url(redis_url)
    Registry(conn, keys, ttl_seconds=600).heartbeat(
        EngineInfo("stand-in-engine", STAND_IN, "normal", "127.0.0.1:1")
    )
    live = start_gateway(keepalive_s=0.2)
    raw: list[str] = []
    texts: list[str] = []
    failures: list[Exception] = []

    def ask_raw() -> None:
        body = {"model": STAND_IN, "prompt": [5, 9], "max_tokens": 4, "stream": True}
        with (
            live.http(timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            raw.extend(line for line in response.iter_lines() if line)

    def ask_sdk() -> None:
        try:
            stream = live.openai().completions.create(
                model=STAND_IN, prompt=[5, 9], max_tokens=4, stream=True
            )
            texts.extend(chunk.choices[0].text for chunk in stream if chunk.choices)
        except Exception as exc:  # reported by the test
            failures.append(exc)

    try:
        for ask in (ask_raw, ask_sdk):
            asking = threading.Thread(target=ask)
            asking.start()
            rid = take_queued(conn, keys)
            writer = ResponseWriter(conn, keys, "stand-in-engine")
            writer.add(rid, ResponseEvent.tokens(0, [40], "a", "stand-in-engine"))
            writer.flush()
            time.sleep(0.9)  # the engine is silent: a keep-alive every 0.2 s
            writer.add(rid, ResponseEvent.tokens(1, [41], "b", "stand-in-engine"))
            writer.add(rid, ResponseEvent.finish(2, "stop", Usage(2, 2), "stand-in-engine"))
            writer.flush()
            asking.join(30)
    finally:
        conn.close()
    assert raw.count(": keep-alive") >= 2, raw
    assert raw[-1] == "data: [DONE]"
    assert not failures, failures
    assert "".join(texts) == "ab"


def test_a_stream_holds_no_copy_of_what_it_sent(start_gateway, redis_url, keys) -> None:
    # Every event's text and logprobs were kept to the stream's end, read by nothing: a
    # long answer with top_logprobs 20 held ~8 KB a token (n 16, 2,000 tokens: 266 MB
    # of a gateway whose pod has 1 GiB).
    conn = redis.Redis.from_url(redis_url)
    Registry(conn, keys, ttl_seconds=600).heartbeat(
        EngineInfo("stand-in-engine", STAND_IN, "normal", "127.0.0.1:1")
    )
    live = start_gateway()
    top = [{"token": f"t{i}", "logprob": -1.5, "bytes": [116, 48 + i]} for i in range(20)]
    entry = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": top}
    received: list[int] = []

    def ask() -> None:
        body = {"model": STAND_IN, "prompt": [5, 9], "max_tokens": 2000, "stream": True}
        body["logprobs"] = 5
        with (
            live.http(timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            for line in response.iter_lines():  # events come merged: count the text
                if line.startswith("data: {"):
                    chunk = json.loads(line.removeprefix("data: "))
                    received.append(sum(len(c["text"]) for c in chunk["choices"]))

    asking = threading.Thread(target=ask)
    tracemalloc.start()
    try:
        asking.start()
        rid = take_queued(conn, keys)
        writer = ResponseWriter(conn, keys, "stand-in-engine")
        baseline = tracemalloc.get_traced_memory()[0]
        for offset in range(2000):
            event = ResponseEvent.tokens(offset, [40], "a", "stand-in-engine", [entry])
            writer.add(rid, event)
            if offset % 100 == 99:
                writer.flush()
        assert eventually(lambda: sum(received) == 2000, 60), "the stream fell behind"
        held = tracemalloc.get_traced_memory()[0] - baseline
        writer.add(rid, ResponseEvent.finish(2000, "length", Usage(5, 2000), "stand-in-engine"))
        writer.flush()
        asking.join(30)
    finally:
        tracemalloc.stop()
        conn.close()
    assert held < 6_000_000, f"{held / 1e6:.1f} MB held for a stream of 2,000 tokens"
