"""The gateway's reader of response streams: it reads them whole, in order, a bounded
batch at a time (what a stalled client holds in the gateway), against a real Redis."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis
from support.polling import eventually

from tandem import catalog
from tandem.gateway.reader import AsyncResponseReader, ResponseGap
from tandem.protocol import PRIORITY_NORMAL, ResponseEvent, Usage, WorkItem


def test_a_long_answer_is_read_whole_in_bounded_batches(redis_url, keys):
    ids = ("r-0", "r-1")
    with redis.Redis.from_url(redis_url) as writer:
        for rid in ids:
            for i in range(10):
                event = ResponseEvent.tokens(i, [i], f"t{i}", "e1")
                writer.xadd(keys.response_stream(rid), event.to_fields())
            done = ResponseEvent.finish(10, "length", Usage(3, 10, 0), "e1")
            writer.xadd(keys.response_stream(rid), done.to_fields())

    async def main() -> tuple[list[tuple[int, ResponseEvent]], list[int]]:
        client = aioredis.Redis.from_url(redis_url)
        taken: list[int] = []
        read = client.xread

        async def counted(*args, **kwargs):
            reply = await read(*args, **kwargs)
            taken.extend(len(entries) for _, entries in reply or ())
            return reply

        client.xread = counted
        reader = AsyncResponseReader(client, keys, batch=3)
        try:
            events = [e async for e in reader.events(ids, deadline=time.monotonic() + 10)]
        finally:
            await client.aclose()
        return events, taken

    events, taken = asyncio.run(main())
    for choice in (0, 1):
        mine = [e for i, e in events if i == choice]
        assert [t for e in mine for t in e.token_ids] == list(range(10))
        assert mine[-1].is_final and mine[-1].finish_reason == "length"
    assert taken and max(taken) <= 3  # each read took at most a batch of each stream


def test_a_batch_below_one_is_refused():
    with pytest.raises(ValueError, match="batch must be at least 1"):
        AsyncResponseReader(None, None, batch=0)  # type: ignore[arg-type]


def _write(writer: redis.Redis, stream: str, events: list[ResponseEvent]) -> None:
    for event in events:
        writer.xadd(stream, event.to_fields())


def test_tokens_never_read_are_a_gap_not_a_shorter_answer(redis_url, keys):
    # Redis came back empty while the gateway had read 5 tokens and its engine served
    # on, writing from token 8 into a new stream: passed on, a hole in the text.
    with redis.Redis.from_url(redis_url) as writer:
        _write(writer, keys.response_stream("r"), [
            ResponseEvent.tokens(0, [0, 1, 2, 3, 4], "01234", "e1"),
            ResponseEvent.tokens(8, [8], "8", "e1"),
            ResponseEvent.finish(9, "length", Usage(3, 9, 0), "e1"),
        ])  # fmt: skip

    async def main() -> list[ResponseEvent]:
        client = aioredis.Redis.from_url(redis_url)
        seen: list[ResponseEvent] = []
        try:
            async for _, event in AsyncResponseReader(client, keys).events(
                ["r"], deadline=time.monotonic() + 10
            ):
                seen.append(event)
        finally:
            await client.aclose()
        return seen

    with pytest.raises(ResponseGap) as caught:
        asyncio.run(main())
    assert (caught.value.seen, caught.value.offset) == (5, 8)


def test_an_answer_redis_lost_part_of_is_a_503_to_retry(start_gateway, redis_client, keys):
    gateway = start_gateway(models_cache_s=0.0)
    catalog.declare(redis_client, keys, "m", "test/m", ttl_s=60)
    answers = []

    def ask() -> None:
        with gateway.http() as client:
            body = {"model": "m", "prompt": "hello", "max_tokens": 9}
            answers.append(client.post("/v1/completions", json=body))

    asker = threading.Thread(target=ask)
    asker.start()
    stream = keys.work_stream("m", PRIORITY_NORMAL)
    assert eventually(lambda: redis_client.xlen(stream) == 1)
    [(_, fields)] = redis_client.xrange(stream)
    rid = WorkItem.from_fields(fields).request_id
    _write(redis_client, keys.response_stream(rid), [  # as an engine whose Redis lost 5-7
        ResponseEvent.tokens(0, [5] * 5, "hello", "e1"),
        ResponseEvent.tokens(8, [6], "!", "e1"),
        ResponseEvent.finish(9, "length", Usage(2, 9, 0), "e1"),
    ])  # fmt: skip
    asker.join(timeout=20)
    [answer] = answers
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "response_lost" and "tokens 5 to 7" in error["message"]
    # Counted as its response ends, which the client may see first.
    counted = lambda: gateway.metric("tandem_gateway_requests_total", status="503", model="m")  # noqa: E731
    assert eventually(lambda: counted() == 1)
