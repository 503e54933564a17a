"""The gateway's asyncio twins of the protocol functions agree with the originals."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from tandem.backlog import ENQUEUE_SCRIPT, enqueue, queue_depth, withdraw
from tandem.engine.service.cancellation import is_cancelled
from tandem.engine.service.registry import Registry
from tandem.engine.service.responses import ResponseWriter
from tandem.engine.service.work_queue import WorkQueue
from tandem.gateway.app import _redis_client
from tandem.gateway.broker import Broker
from tandem.gateway.errors import GatewayError
from tandem.gateway.idempotency import PENDING_WAIT_S, IdempotencyLedger, IdempotencyRecord
from tandem.gateway.settings import GatewaySettings
from tandem.protocol import ResponseEvent, Role, WorkItem
from tandem.registry_entry import EngineInfo


def _run(redis_url, keys, work):
    async def main():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await work(Broker(client, keys))
        finally:
            await client.aclose()

    return asyncio.run(main())


def _fields(conn, stream):
    [(_, fields)] = conn.xrange(stream)
    return {k: v for k, v in fields.items() if k != b"data"}, WorkItem.from_fields(fields)


def test_enqueue_writes_what_the_original_writes(redis_url, keys, redis_client):
    item = WorkItem("a", "m", prompt="hello", priority=2, estimated_prompt_tokens=7, deadline=9.0)
    twin = WorkItem("b", "m", prompt="hello", priority=2, estimated_prompt_tokens=7, deadline=9.0)
    _run(redis_url, keys, lambda b: b.enqueue([item]))
    ours = _fields(redis_client, keys.work_stream("m", 2))
    redis_client.delete(keys.work_stream("m", 2))
    enqueue(redis_client, keys, twin)
    theirs = _fields(redis_client, keys.work_stream("m", 2))
    assert ours[0] == theirs[0]  # v, kind, tokens
    assert ours[1].prompt == theirs[1].prompt and ours[1].deadline == 9.0
    assert int(redis_client.get(keys.queued_tokens("m"))) == 14


def test_n_items_queue_in_one_transaction_and_an_engine_takes_them(redis_url, keys, redis_client):
    items = [WorkItem(f"r-{i}", "m", prompt="x" * 8, estimated_prompt_tokens=2) for i in range(3)]
    ids = _run(redis_url, keys, lambda b: b.enqueue(items))
    assert len(ids) == 3 and int(redis_client.get(keys.queued_tokens("m"))) == 6
    queue = WorkQueue(redis_client, keys, "m", Role.NORMAL, "engine-1")
    pulled = queue.pull(10)
    assert [d.request_id for d in pulled.work] == ["r-0", "r-1", "r-2"]
    assert int(redis_client.get(keys.queued_tokens("m"))) == 0


@pytest.mark.parametrize("twin", ["gateway", "original"])
def test_withdrawing_takes_back_only_what_no_engine_read(redis_url, keys, redis_client, twin):
    items = [WorkItem(f"w-{i}", "m", prompt="x", estimated_prompt_tokens=3) for i in range(4)]
    ids = [enqueue(redis_client, keys, items[0])]  # before any engine made the group
    withdraw_first = (
        _run(redis_url, keys, lambda b: b.withdraw("m", 1, ids))
        if twin == "gateway"
        else withdraw(redis_client, keys, "m", 1, ids)
    )
    assert withdraw_first == 1 and int(redis_client.get(keys.queued_tokens("m"))) == 0
    ids = [enqueue(redis_client, keys, item) for item in items[1:]]
    queue = WorkQueue(redis_client, keys, "m", Role.NORMAL, "engine-1")
    assert [d.request_id for d in queue.pull(1).work] == ["w-1"]  # read: its engine's
    withdrawn = (
        _run(redis_url, keys, lambda b: b.withdraw("m", 1, [*ids, ids[-1]]))
        if twin == "gateway"
        else withdraw(redis_client, keys, "m", 1, [*ids, ids[-1]])
    )
    assert withdrawn == 2  # w-2 and w-3, once each
    depth = queue_depth(redis_client, keys, "m")
    assert (depth.total_waiting, depth.pending, depth.queued_tokens) == (0, 1, 0)


def test_a_request_id_is_queued_once_however_often_it_is_enqueued(redis_url, keys, redis_client):
    item = WorkItem("r", "m", prompt="x", estimated_prompt_tokens=5)
    first = enqueue(redis_client, keys, item)
    assert enqueue(redis_client, keys, item) == first
    items = [item, WorkItem("s", "m", prompt="y", estimated_prompt_tokens=3)]
    ids = _run(redis_url, keys, lambda b: b.enqueue(items))
    assert ids[0] == first and ids[1] != first
    assert redis_client.xlen(keys.work_stream("m", 1)) == 2
    assert int(redis_client.get(keys.queued_tokens("m"))) == 8


class _ReplyDropper:
    """A TCP proxy to Redis that closes the connection in place of forwarding the
    reply to the first command whose bytes hold `command`: Redis ran it, the client
    never hears."""

    def __init__(self, redis_url: str, command: bytes = b"EVALSHA") -> None:
        target = urlsplit(redis_url)
        self.target = (target.hostname, target.port)
        self.command = command
        self.dropped = False

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _serve(self, client_r, client_w) -> None:
        redis_r, redis_w = await asyncio.open_connection(*self.target)
        script_sent = asyncio.Event()

        async def upstream() -> None:
            while data := await client_r.read(65536):
                if self.command in data and not self.dropped:
                    script_sent.set()
                redis_w.write(data)
                await redis_w.drain()

        async def downstream() -> None:
            while data := await redis_r.read(65536):
                if script_sent.is_set() and not self.dropped:
                    self.dropped = True
                    break
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        client_w.close()
        redis_w.close()


def test_an_enqueue_whose_reply_was_lost_is_not_queued_twice(redis_url, keys, redis_client):
    # The gateway's client runs a command again on a dead connection. An enqueue
    # that Redis ran before the connection died is run again: it must not add a
    # second entry, which an engine would answer a second time into one stream.
    redis_client.script_load(ENQUEUE_SCRIPT)  # the first call runs, rather than NOSCRIPT
    item = WorkItem("r", "m", prompt="x", estimated_prompt_tokens=5)

    async def main():
        proxy = _ReplyDropper(redis_url)
        url = await proxy.start()
        client = _redis_client(GatewaySettings(redis_url=url, no_auth=True))
        try:
            ids = await Broker(client, keys).enqueue([item])
            return proxy.dropped, ids
        finally:
            await client.aclose()
            proxy.server.close()

    dropped, ids = asyncio.run(main())
    assert dropped
    [(entry_id, _)] = redis_client.xrange(keys.work_stream("m", 1))
    assert ids == [entry_id.decode()]
    assert int(redis_client.get(keys.queued_tokens("m"))) == 5


def test_an_idempotency_claim_whose_reply_was_lost_still_queues(redis_url, keys):
    # The SET NX ran; its retry finds the record. It is this request's own: attaching
    # to it (as to a first attempt's) would queue nothing and time out.
    record = IdempotencyRecord("chatcmpl-1", ["chatcmpl-1"], 1, "digest")

    async def main():
        proxy = _ReplyDropper(redis_url, command=b":idem:")
        url = await proxy.start()
        client = _redis_client(GatewaySettings(redis_url=url, no_auth=True))
        try:
            ledger = IdempotencyLedger(client, keys.prefix)
            claimed = await ledger.claim(ledger.key("caller", "order-7"), record, timeout=30)
            return proxy.dropped, claimed
        finally:
            await client.aclose()
            proxy.server.close()

    dropped, claimed = asyncio.run(main())
    assert dropped and claimed is None  # go ahead and queue


def _with_ledger(redis_url, keys, idempotency_key, work):
    """work(ledger, record key) on a ledger of its own client."""

    async def main():
        client = aioredis.Redis.from_url(redis_url)
        ledger = IdempotencyLedger(client, keys.prefix)
        try:
            return await work(ledger, ledger.key("caller", idempotency_key))
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_a_retry_whose_first_attempt_leaves_as_it_attaches_queues_afresh(redis_url, keys):
    # The look at the record and the count of readers were two round trips: the first
    # attempt's last reader left between them (the record released, the work
    # cancelled), and the retry attached to cancelled work, its answer "cancelled".
    first = IdempotencyRecord("chatcmpl-a", ["chatcmpl-a"], 1, "digest")
    retry = IdempotencyRecord("chatcmpl-b", ["chatcmpl-b"], 2, "digest")

    async def work(ledger, key):
        assert await ledger.claim(key, first, timeout=30) is None
        await ledger.queued(key, first)
        attach = ledger._attach

        async def first_leaves_then_attach(**kwargs):
            assert await ledger.leave(key, first.base_id, first.base_id) == 0  # the last
            return await attach(**kwargs)

        ledger._attach = first_leaves_then_attach
        claimed = await ledger.claim(key, retry, timeout=30)
        ledger._attach = attach
        await ledger.queued(key, retry)
        # The retry's record now: a third attempt attaches to it, two readers.
        third = await ledger.claim(key, IdempotencyRecord("c", ["c"], 3, "digest"), 30)
        return claimed, third, await ledger.leave(key, retry.base_id, retry.base_id)

    claimed, third, left = _with_ledger(redis_url, keys, "order-9", work)
    assert claimed is None  # queue afresh
    assert third is not None and third.base_id == retry.base_id
    assert left == 1  # the third attempt still reads it


def test_a_retry_with_a_shorter_deadline_leaves_the_readers_count_its_time(
    redis_url, keys, redis_client
):
    # The attach set the readers' TTL to the retry's own: past it they were gone,
    # and the first attempt, still reading, was taken for the last reader.
    first = IdempotencyRecord("chatcmpl-a", ["chatcmpl-a"], 1, "digest")

    async def work(ledger, key):
        await ledger.claim(key, first, timeout=3000)
        await ledger.queued(key, first)
        retry = IdempotencyRecord("chatcmpl-b", ["chatcmpl-b"], 2, "digest")
        await ledger.claim(key, retry, timeout=10)
        return key

    key = _with_ledger(redis_url, keys, "order-10", work)
    for readers in ("readers", "attempts"):
        assert redis_client.ttl(f"{key}:{readers}:chatcmpl-a") > 3000


def test_an_attempt_leaving_twice_is_counted_out_once(redis_url, keys):
    # A leave whose reply a Redis pause lost runs when Redis resumes, and the cancel
    # that waited for Redis leaves again: counted down twice, the work's other reader
    # was taken for gone and its answer cancelled.
    first = IdempotencyRecord("chatcmpl-a", ["chatcmpl-a"], 1, "digest")
    retry = IdempotencyRecord("chatcmpl-b", ["chatcmpl-b"], 2, "digest")

    async def work(ledger, key):
        await ledger.claim(key, first, timeout=30)
        await ledger.queued(key, first)
        assert await ledger.claim(key, retry, timeout=30) is not None  # attached
        once = await ledger.leave(key, first.base_id, first.base_id)
        twice = await ledger.leave(key, first.base_id, first.base_id)
        last = await ledger.leave(key, first.base_id, retry.base_id)
        return once, twice, last

    assert _with_ledger(redis_url, keys, "order-11", work) == (1, 1, 0)


def test_readers_through_gateways_of_before_the_set_share_one_tally(redis_url, keys):
    # A rolling upgrade: a gateway of before the readers' set moves their count alone
    # (INCR as it attaches, DECR as it leaves). Counted apart, one reader leaving took
    # the work from the other, whichever version each came through.
    first = IdempotencyRecord("chatcmpl-a", ["chatcmpl-a"], 1, "digest")

    async def work(ledger, key):
        await ledger.claim(key, first, timeout=30)
        await ledger.queued(key, first)
        count = f"{key}:readers:{first.base_id}"
        await ledger.client.incr(count)  # an older gateway's retry attaches
        mine_left = await ledger.leave(key, first.base_id, first.base_id)
        record_kept = await ledger.client.exists(key)
        await ledger.client.decr(count)  # the older retry leaves: it reads 0, it cancels
        return mine_left, record_kept, int(await ledger.client.get(count))

    assert _with_ledger(redis_url, keys, "order-12", work) == (1, 1, 0)


def test_a_retry_waits_for_the_first_attempts_work_to_be_queued_or_refused(redis_url, keys):
    # Claimed before its queue room and quota were checked, the first attempt was then
    # refused (429) and released its record; a retry that had attached in between read
    # streams no engine would ever write, until its deadline: a 504 for a 429.
    first = IdempotencyRecord("chatcmpl-a", ["chatcmpl-a"], 1, "digest")
    retry = IdempotencyRecord("chatcmpl-b", ["chatcmpl-b"], 2, "digest")

    async def work(ledger, key):
        assert await ledger.claim(key, first, timeout=30) is None
        waiting = asyncio.create_task(ledger.claim(key, retry, timeout=30))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # not attached to work that is not queued
        await ledger.release(key, first.base_id)  # refused
        refused = await waiting  # the retry's own claim: it queues afresh
        await ledger.queued(key, retry)
        third = IdempotencyRecord("chatcmpl-c", ["chatcmpl-c"], 3, "digest")
        return refused, await ledger.claim(key, third, timeout=30)

    refused, attached = _with_ledger(redis_url, keys, "order-11", work)
    assert refused is None
    assert attached is not None and attached.base_id == "chatcmpl-b"  # queued: attaches


def test_another_request_under_a_key_being_queued_is_a_409_at_once(redis_url, keys):
    # It waited for the first attempt's work to be queued before comparing contents.
    first = IdempotencyRecord("chatcmpl-a", ["chatcmpl-a"], 1, "digest")
    other = IdempotencyRecord("chatcmpl-b", ["chatcmpl-b"], 2, "other digest")

    async def work(ledger, key):
        assert await ledger.claim(key, first, timeout=30) is None  # not queued yet
        started = time.monotonic()
        with pytest.raises(GatewayError) as caught:
            await ledger.claim(key, other, timeout=30)
        return caught.value.status, time.monotonic() - started

    status, took = _with_ledger(redis_url, keys, "order-13", work)
    assert status == 409 and took < PENDING_WAIT_S / 2


def test_a_record_its_attempt_never_queued_is_taken_over(redis_url, keys, monkeypatch):
    # The first attempt's gateway died between the claim and the queueing.
    monkeypatch.setattr("tandem.gateway.idempotency.PENDING_WAIT_S", 0.3)
    first = IdempotencyRecord("chatcmpl-a", ["chatcmpl-a"], 1, "digest")
    retry = IdempotencyRecord("chatcmpl-b", ["chatcmpl-b"], 2, "digest")

    async def work(ledger, key):
        assert await ledger.claim(key, first, timeout=30) is None
        return await ledger.claim(key, retry, timeout=30)

    assert _with_ledger(redis_url, keys, "order-12", work) is None  # queue it afresh


def test_queue_depth_matches_the_original(redis_url, keys, redis_client):
    assert _run(redis_url, keys, lambda b: b.queue_depth("m")) == queue_depth(
        redis_client, keys, "m"
    )  # no group yet
    for i in range(4):
        enqueue(redis_client, keys, WorkItem(f"r{i}", "m", prompt="x", estimated_prompt_tokens=1))
    enqueue(redis_client, keys, WorkItem("h", "m", prompt="x", priority=2))
    WorkQueue(redis_client, keys, "m", Role.NORMAL, "e").pull(2)  # two pending
    ours = _run(redis_url, keys, lambda b: b.queue_depth("m"))
    assert ours == queue_depth(redis_client, keys, "m")
    assert ours.total_waiting == 3 and ours.pending == 2


def test_cancel_sets_the_key_and_publishes(redis_url, keys, redis_client):
    pubsub = redis_client.pubsub()
    pubsub.subscribe(keys.cancel_channel)
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    _run(redis_url, keys, lambda b: b.cancel(["x", "y"]))
    assert is_cancelled(redis_client, keys, "x") and is_cancelled(redis_client, keys, "y")
    heard = [pubsub.get_message(timeout=1)["data"] for _ in range(2)]
    assert heard == [b"x", b"y"]
    pubsub.close()


def test_live_engines_match_the_registry_and_prune_alike(redis_url, keys, redis_client):
    registry = Registry(redis_client, keys, ttl_seconds=0.2)
    registry.heartbeat(EngineInfo("old", "m", "normal", "h:1"))
    time.sleep(0.3)
    Registry(redis_client, keys, ttl_seconds=30).heartbeat(EngineInfo("e2", "m", "prompt", "h:2"))
    Registry(redis_client, keys, ttl_seconds=30).heartbeat(EngineInfo("e1", "n", "normal", "h:3"))
    redis_client.sadd(keys.engines_set, "garbled")
    redis_client.set(keys.engine_key("garbled"), "not json")
    ours = _run(redis_url, keys, lambda b: b.live_engines())
    assert [e.engine_id for e in ours] == ["e1", "e2"]
    assert redis_client.smembers(keys.engines_set) == {b"e1", b"e2", b"garbled"}  # "old" pruned
    theirs = Registry(redis_client, keys).live("m")
    assert _run(redis_url, keys, lambda b: b.live_engines("m")) == theirs


def test_unready_says_why_redis_does_not_serve(redis_url, keys):
    assert _run(redis_url, keys, lambda b: b.unready(1.0)) is None
    closed = "redis://127.0.0.1:1/0"
    assert _run(closed, keys, lambda b: b.unready(1.0)) == "Redis is unreachable"


def test_held_finds_work_by_its_entry_its_marker_or_its_response_stream(
    redis_url, keys, redis_client
):
    # After a Redis restart, a request counts as lost only if none of the three is
    # left: an entry queued long ago has no marker (60 s), a taken one no entry.
    item = WorkItem("r", "m", prompt="x", priority=0)
    [entry_id] = _run(redis_url, keys, lambda b: b.enqueue([item]))

    def held(entry: str | None = entry_id) -> bool:
        return _run(redis_url, keys, lambda b: b.held([item], [entry]))[0]

    assert held()
    redis_client.delete(keys.enqueued("m", "r"))  # its marker expired
    assert held() and not held(None)  # its entry (an attached request knows no entry id)
    redis_client.xdel(keys.work_stream("m", 0), entry_id)
    assert not held()  # lost
    writer = ResponseWriter(redis_client, keys, "e")
    writer.add("r", ResponseEvent.tokens(0, [4], "a", "e"))
    writer.flush()
    assert held()  # an engine acks an entry only after writing its outcome


def test_requeue_queues_lost_work_once_after_what_its_client_was_sent(
    redis_url, keys, redis_client
):
    item = WorkItem("r", "m", prompt="x", priority=2, deadline=99.0, estimated_prompt_tokens=3)
    sent = ResponseEvent.tokens(0, [7, 8, 9], "abc", "gateway")

    async def twice(broker: Broker) -> list[list[str]]:
        # Run again (a reply lost on a dead connection): queued once, history harmless.
        return [await broker.requeue([item], [sent]), await broker.requeue([item], [sent])]

    first, again = _run(redis_url, keys, twice)
    assert first == again and redis_client.xlen(keys.work_stream("m", 2)) == 1
    assert int(redis_client.get(keys.queued_tokens("m"))) == 3
    # What an engine taking it reads: the same request, to resume after 3 tokens.
    history = ResponseWriter(redis_client, keys, "e").history("r")
    assert history.token_ids == [7, 8, 9] and history.text == "abc" and history.final is None
    [delivery] = WorkQueue(redis_client, keys, "m", Role.NORMAL, "engine-1").pull(10).work
    assert (delivery.request_id, delivery.message.deadline) == ("r", 99.0)
