"""A real engine process through a Redis that pauses, crashes, or comes back empty.

Each test has a redis-server of its own (the session's is shared): paused with
SIGSTOP, or killed and started again on the same port. The engine must keep its
running requests and their output through it and finish them once Redis is back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import redis
from support.engines import Client, EngineProcess
from support.polling import eventually

from tandem.engine import LLM, SamplingParams
from tandem.engine.service.redis_outage import RedisOutage, unavailable
from tandem.engine.service.registry import Registry
from tandem.protocol import WORK_GROUP, EventKind, ResponseEvent
from tandem.redis_server import RedisServer

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Room for 2,000 tokens: seconds of decoding for four requests on a 2-core CPU, so
# they are still running when Redis goes away, and go on while it is away.
LONG = ("--max-model-len", "2048", "--num-kv-blocks", "160")
PROMPTS = [[5, 9, 17, 33, 2, 101, n] for n in range(4)]
MAX_TOKENS = 2000


@pytest.fixture(scope="module")
def expected():
    """What the offline engine generates for PROMPTS on the same seeded weights."""
    llm = LLM("random:tiny", max_model_len=2048, num_kv_blocks=160)
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    return [out.token_ids for out in llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)]


@pytest.fixture
def server(request):
    """This test's own Redis; @pytest.mark.parametrize("server", [True], indirect=True)
    gives it an append-only file, as `tandem up` runs it."""
    with RedisServer(appendonly=getattr(request, "param", False)) as server:
        yield server


@pytest.fixture
def redis_url(server):  # the engines and the client below use this test's Redis
    return server.url


def submit_all(client: Client) -> list[str]:
    rids = [
        client.submit(prompt_token_ids=p, sampling={"max_tokens": MAX_TOKENS, **GREEDY})
        for p in PROMPTS
    ]
    for rid in rids:  # each one running before Redis goes
        next(e for e in client.events(rid) if e.event == EventKind.TOKENS)
    return rids


def readyz(engine: EngineProcess) -> tuple[int, float]:
    started = time.monotonic()
    try:
        with urllib.request.urlopen(engine.url("/readyz"), timeout=10) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    return status, time.monotonic() - started


def settled(engine: EngineProcess, client: Client, redis_url: str) -> None:
    """Back to normal: registered, ready, nothing left pending."""
    registry = Registry(client.redis, client.keys)
    assert eventually(lambda: engine.engine_id in {e.engine_id for e in registry.live()})
    assert eventually(lambda: readyz(engine)[0] == 200)
    assert engine.process.poll() is None
    stream = client.keys.work_stream("tiny", 1)
    assert eventually(lambda: client.redis.xpending(stream, WORK_GROUP)["pending"] == 0)


def test_a_paused_redis_holds_the_output_back_and_loses_none(
    server, engines, client, expected, redis_url
):
    engine = engines("normal", *LONG)
    rids = submit_all(client)
    steps = engine.metric("tandem_engine_steps_total")
    os.kill(server._process.pid, signal.SIGSTOP)
    try:
        status, took = readyz(engine)  # a quick answer, not the Redis client's 5 s
        assert status == 503 and took < 2
        time.sleep(8)
        # The loop went on stepping: the requests' tokens wait in the engine.
        stepped = engine.metric("tandem_engine_steps_total") - steps
        status, took = readyz(engine)
        assert status == 503 and took < 2
    finally:
        os.kill(server._process.pid, signal.SIGCONT)
    assert stepped > 5, engine.log()
    for rid, tokens in zip(rids, expected, strict=True):
        answer = client.answer(rid)  # the whole stream, read again from its start
        assert answer.ok, answer.final
        assert answer.token_ids == tokens
    settled(engine, client, redis_url)
    log = engine.log()
    # Said once each way, not at every retry, nor by the heartbeat thread at each beat.
    assert log.count("Redis unavailable") == 1, log
    assert log.count("Redis reachable again") == 1, log
    assert "heartbeat failed" not in log and log.count("cancel listener") <= 1, log


@pytest.mark.parametrize("server", [True], indirect=True)
def test_a_redis_killed_and_restarted_from_its_file_is_ridden_out(
    server, engines, client, expected, redis_url
):
    engine = engines("normal", *LONG)
    rids = submit_all(client)
    server.kill()
    time.sleep(3)
    server.start()
    for rid, tokens in zip(rids, expected, strict=True):
        answer = client.answer(rid)
        assert answer.ok, answer.final
        assert answer.token_ids == tokens
    settled(engine, client, redis_url)


def test_a_redis_back_empty_gets_its_groups_again_and_the_running_requests_end(
    server, engines, client, expected, redis_url
):
    engine = engines("normal", *LONG)
    rids = submit_all(client)
    server.kill()  # no append-only file: it comes back with nothing
    time.sleep(2)
    server.start()
    # A gateway queues a lost request again (docs/gateway.md, "Redis restarts"): the
    # engine still running it adopts that entry, so it is acknowledged, not left
    # pending (and then run a second time by whichever engine reclaims it).
    client.submit(
        request_id=rids[0],
        prompt_token_ids=PROMPTS[0],
        sampling={"max_tokens": MAX_TOKENS, **GREEDY},
    )
    for rid, tokens in zip(rids, expected, strict=True):
        events = list(client.events(rid))  # only what was written after the restart
        assert events[-1].event == EventKind.FINISH, events[-1]
        assert events[-1].usage["completion_tokens"] == MAX_TOKENS
        first = events[0].offset
        written = [t for e in events for t in e.token_ids]
        assert written == tokens[first:]  # the rest of the answer, undamaged
    # Its consumer group is back: a new request is served.
    rid = client.submit(prompt_token_ids=PROMPTS[0], sampling={"max_tokens": 8, **GREEDY})
    assert client.answer(rid).token_ids == expected[0][:8]
    settled(engine, client, redis_url)
    assert "consumer groups were gone" in engine.log()


def test_requests_that_end_while_a_redis_back_empty_is_away_again_are_answered(
    server, engines, client, redis_url
):
    # Their entries lost with the first restart, the requests went on; they ended during
    # a second outage, and at its end the engine took its own tokens in their new streams
    # for another engine's: it dropped their final events, and the clients waited on.
    engine = engines("normal", *LONG)
    sampling = {"max_tokens": MAX_TOKENS, **GREEDY}
    rids = [client.submit(prompt_token_ids=p, sampling=sampling) for p in PROMPTS]
    for rid in rids:
        next(e for e in client.events(rid) if e.event == EventKind.TOKENS)
    server.kill()  # no append-only file: it comes back with nothing
    time.sleep(1)
    server.start()
    streams = [client.keys.response_stream(rid) for rid in rids]
    assert eventually(lambda: all(client.redis.exists(s) for s in streams), 60), engine.log()
    os.kill(server._process.pid, signal.SIGSTOP)
    try:
        running = "tandem_engine_requests_running"
        assert eventually(lambda: engine.metric(running) == 0, 120), "never finished"
    finally:
        os.kill(server._process.pid, signal.SIGCONT)
    for rid in rids:
        events = list(client.events(rid, timeout=30))
        assert events[-1].event == EventKind.FINISH, events[-1]
        assert events[-1].usage["completion_tokens"] == MAX_TOKENS


def queue_again(client: Client, rid: str, max_tokens: int = MAX_TOKENS) -> None:
    """What a gateway does for a request a Redis restart lost: a new entry, same id
    (its enqueued marker dropped, as a restart without data drops it)."""
    client.redis.delete(client.keys.enqueued("tiny", rid))
    sampling = {"max_tokens": max_tokens, **GREEDY}
    client.submit(request_id=rid, prompt_token_ids=PROMPTS[0], sampling=sampling)


def test_a_request_queued_again_while_its_first_entry_is_held_is_answered_once(
    engines, client, expected, redis_url
):
    engine = engines("normal", *LONG)
    rids = submit_all(client)
    queue_again(client, rids[0])  # a second entry while the first is still pending
    answer = client.answer(rids[0])
    assert answer.ok and answer.token_ids == expected[0]
    assert answer.engines == {engine.engine_id}
    # Both entries acknowledged now, not the second left for the claim timeout (30 s).
    settled(engine, client, redis_url)


def test_a_prefilled_offer_queued_again_is_prefilled_anew(engines, client):
    prompt = engines("prompt", *LONG)  # no decoder: its offer stays pinned
    rid = client.submit(prompt_token_ids=PROMPTS[0], sampling={"max_tokens": 8, **GREEDY})
    handoffs = client.keys.handoff_stream("tiny")
    assert eventually(lambda: client.redis.xlen(handoffs) == 1)
    queue_again(client, rid, max_tokens=8)  # its Handoff lost with Redis, say
    assert eventually(lambda: client.redis.xlen(handoffs) == 2), prompt.log()
    entries = client.redis.xrange(client.keys.response_stream(rid))
    events = [ResponseEvent.from_fields(fields) for _, fields in entries]
    assert all(e.event != EventKind.ERROR for e in events), events
    assert prompt.process.poll() is None


def test_a_drain_that_runs_out_with_redis_away_exits_and_says_what_is_lost(server, engines, client):
    engine = engines("normal", "--drain-timeout", "1", *LONG)
    submit_all(client)
    server.kill()
    assert engine.terminate(timeout=30) == 0
    assert "stopping with Redis unreachable" in engine.log()


def test_an_idle_engine_stopped_while_redis_is_paused_says_nothing_was_lost(server, engines):
    # It warned that "0 requests running, 0 events and 0 acks to write are lost".
    engine = engines("normal", *LONG)
    os.kill(server._process.pid, signal.SIGSTOP)
    try:
        # Stopped before it noticed the pause, it wrote nothing and so said nothing.
        assert eventually(lambda: "Redis unavailable" in engine.log(), 30), engine.log()
        assert engine.terminate(timeout=30) == 0
    finally:
        os.kill(server._process.pid, signal.SIGCONT)
    assert " INFO " in next(x for x in engine.log().splitlines() if "nothing was held" in x)
    assert "are lost" not in engine.log()


def test_a_full_redis_is_waited_out_like_an_absent_one(server, engines, client, expected):
    # maxmemory with noeviction (the chart's Redis): writes are refused with OOM while
    # PING still answers. Engines ended on the first refused XADD or heartbeat, every
    # one of them at once, and restarted into the same refusal.
    engine = engines("normal", *LONG)
    rids = submit_all(client)
    admin = redis.Redis.from_url(server.url)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            admin.set("anything", "1")
        time.sleep(3)  # past heartbeats, and a flush at every step
        assert engine.process.poll() is None, engine.log()
        assert readyz(engine)[0] == 503  # it takes no work while Redis refuses it
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    for rid, tokens in zip(rids, expected, strict=True):
        answer = client.answer(rid)
        assert answer.ok, answer.final
        assert answer.token_ids == tokens
    log = engine.log()
    assert "Redis unavailable (OutOfMemoryError" in log and "Redis reachable again" in log, log


@pytest.mark.parametrize(
    ("error", "waits"),
    [
        (
            redis.exceptions.OutOfMemoryError(
                "command not allowed when used memory > 'maxmemory'."
            ),
            True,
        ),
        (redis.exceptions.ReadOnlyError("You can't write against a read only replica."), True),
        (redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but ..."), True),
        # As redis.call() errors come out of a Lua script.
        (
            redis.ResponseError(
                "Error running script (call to f_4d01): @user_script:8: -OOM command not allowed"
            ),
            True,
        ),
        (
            redis.ResponseError(
                "Error running script (call to f_4d01): @user_script:8: MISCONF Redis is"
            ),
            True,
        ),
        (
            redis.ResponseError(
                "BUSY Redis is busy running a script. You can only call SCRIPT KILL or "
                "SHUTDOWN NOSAVE."
            ),
            True,
        ),
        (redis.ConnectionError("Error 111 connecting"), True),
        (
            redis.ResponseError(
                "WRONGTYPE Operation against a key holding the wrong kind of value"
            ),
            False,
        ),
        (redis.ResponseError("ERR wrong number of arguments for 'xadd' command"), False),
    ],
)
def test_refusals_are_waited_out_and_bugs_are_not(error, waits):
    assert unavailable(error) is waits


def test_a_failure_while_the_last_watcher_exits_starts_another():
    # The watcher had seen a PING through and was exiting; the next write failed (Redis
    # flapping at maxmemory): no new watcher started, and the engine never wrote again.
    outage = RedisOutage(lambda: True, first_retry_s=0.01, max_retry_s=0.01)
    outage.failed(redis.ConnectionError("gone"), "nothing")
    assert eventually(outage.may_try, 5)
    exiting = threading.Event()
    outage._watcher = threading.Thread(target=exiting.wait)  # alive, its work done
    outage._watcher.start()
    try:
        outage.failed(redis.ConnectionError("gone again"), "nothing")
        assert eventually(outage.may_try, 5)
    finally:
        exiting.set()


def test_a_request_redis_lost_is_dropped_here_once_another_engine_serves_it(
    server, engines, client
):
    # Its entry lost with Redis's data, the engine went on with it, and looked at its
    # stream only then: queued again by a gateway and taken by another engine, it ran to
    # the end on both (KV and a slot held for an answer the client had from the other).
    # A model slow enough to decode for a while yet; keep-alives every second.
    engine = engines("normal", "--model", "random:medium", *LONG, "--claim-idle-ms", "4000")
    sampling = {"max_tokens": MAX_TOKENS, **GREEDY}
    rid = client.submit(prompt_token_ids=PROMPTS[0], sampling=sampling)
    next(e for e in client.events(rid) if e.event == EventKind.TOKENS)
    server.kill()  # no append-only file: it comes back with nothing
    time.sleep(1)
    server.start()
    assert eventually(lambda: "Redis lost its entry; served on here" in engine.log(), 30)
    stream = client.keys.response_stream(rid)
    assert engine.metric("tandem_engine_requests_running") == 1  # nobody else has it
    # The engine that took the entry a gateway queued again writes its first tokens.
    other = ResponseEvent.tokens(0, PROMPTS[0][:1], "x", "engine-b")
    client.redis.xadd(stream, other.to_fields())
    assert eventually(lambda: "is served elsewhere now" in engine.log(), 30), engine.log()
    assert eventually(lambda: engine.metric("tandem_engine_requests_running") == 0, 10)


def test_an_unreadable_event_in_a_lost_requests_stream_drops_it_not_the_engine(engines, client):
    # Its entry and the data epoch gone, the engine looked at the request's stream to
    # see whether another engine served it: an event of another protocol version there
    # raised through the loop, and the engine ended as if a flag were bad (exit 2, no
    # traceback), its other requests not handed back.
    engine = engines("normal", "--model", "random:medium", *LONG, "--claim-idle-ms", "4000")
    sampling = {"max_tokens": MAX_TOKENS, **GREEDY}
    rid = client.submit(prompt_token_ids=PROMPTS[0], sampling=sampling)
    next(e for e in client.events(rid) if e.event == EventKind.TOKENS)
    for stream in client.keys.work_streams("tiny"):
        for entry in client.redis.xpending_range(stream, WORK_GROUP, "-", "+", 10):
            client.redis.xack(stream, WORK_GROUP, entry["message_id"])
    client.redis.delete(client.keys.data_epoch)  # as if Redis lost its data
    stream = client.keys.response_stream(rid)
    client.redis.xadd(stream, {"v": "9", "kind": "event", "data": "{}"})
    assert eventually(lambda: "taken as served elsewhere" in engine.log(), 30), engine.log()
    assert eventually(lambda: engine.metric("tandem_engine_requests_running") == 0, 10)
    assert engine.process.poll() is None, engine.log()
    # Said as a warning, which an alert on the level can tell from an info line.
    [line] = [x for x in engine.log().splitlines() if "taken as served elsewhere" in x]
    assert " WARNING tandem.engine" in line, line
