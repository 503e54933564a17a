"""The gateway's reader of response streams: it reads them whole, in order, a bounded
batch at a time (what a stalled client holds in the gateway), against a real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis

from tandem.gateway.reader import AsyncResponseReader
from tandem.protocol import ResponseEvent, Usage


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
