"""Response streams: writer, history, reader and the de-duplication of overlaps."""

import itertools
import threading
import time

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from support.response_reader import ResponseReader

from tandem.deduplicator import ResponseDeduplicator
from tandem.engine.service.responses import ResponseWriter
from tandem.protocol import (
    RESPONSE_TTL_SECONDS,
    ErrorCode,
    EventKind,
    ProtocolError,
    ResponseEvent,
    Usage,
)
from tandem.redis_server import RedisServer


def text_of(tokens):
    return "".join(f"<{t}>" for t in tokens)


def tokens_event(start, stop, engine="a"):
    """Tokens start..stop-1; token t is the number t and decodes to "<t>"."""
    ids = list(range(start, stop))
    return ResponseEvent.tokens(start, ids, text_of(ids), engine)


def finish(offset, engine="a"):
    return ResponseEvent.finish(offset, "length", Usage(3, offset), engine)


def test_flush_sends_the_buffer_in_order_with_a_ttl(redis_client, keys):
    writer = ResponseWriter(redis_client, keys, "e1")
    writer.add("r1", tokens_event(0, 2, engine=""))
    writer.add("r2", tokens_event(0, 1))
    writer.add("r1", tokens_event(2, 3))
    writer.add("r1", finish(3))
    assert len(writer) == 4
    assert redis_client.exists(keys.response_stream("r1")) == 0  # buffered only
    assert writer.flush() == 4
    assert len(writer) == 0 and writer.flush() == 0
    events = [e for _, e in ResponseReader(redis_client, keys).read("r1")]
    assert [(e.event, e.offset, e.token_ids) for e in events] == [
        (EventKind.TOKENS, 0, [0, 1]),
        (EventKind.TOKENS, 2, [2]),
        (EventKind.FINISH, 3, []),
    ]
    assert events[0].engine_id == "e1"  # filled in when the event named no engine
    for request_id in ("r1", "r2"):
        ttl = redis_client.ttl(keys.response_stream(request_id))
        assert RESPONSE_TTL_SECONDS - 5 < ttl <= RESPONSE_TTL_SECONDS


def test_a_request_taken_over_loses_its_unsent_events(redis_client, keys):
    # Written after the new owner's final event, they were stale (and renewed the TTL).
    writer = ResponseWriter(redis_client, keys, "e1")
    writer.add("r1", tokens_event(0, 2))
    writer.add("r2", tokens_event(0, 1))
    writer.add("r1", finish(2))
    writer.discard("r1")
    writer.add("r2", tokens_event(1, 2))  # still merged into r2's run
    assert writer.flush() == 1
    assert redis_client.exists(keys.response_stream("r1")) == 0
    events = [e for _, e in ResponseReader(redis_client, keys).read("r2")]
    assert [(e.offset, e.token_ids) for e in events] == [(0, [0, 1])]


def test_events_held_back_by_an_outage_are_written_in_order_one_per_request(keys):
    # Redis away: the engine keeps stepping and adding events. Kept one per step, a
    # long outage would hold an object per token; merged, it holds the tokens.
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        writer = ResponseWriter(client, keys, "a")
        server.kill()
        for start in range(6):
            writer.add("r1", tokens_event(start, start + 1))
            writer.add("r2", tokens_event(start, start + 1))
        with pytest.raises(redis.ConnectionError):
            writer.flush()
        writer.add("r1", finish(6))
        writer.add("r1", tokens_event(6, 7))  # after a final event: not merged into it
        assert len(writer) == 4
        server.start()
        assert writer.flush() == 4
        events = [e for _, e in ResponseReader(client, keys).read("r1")]
        assert [(e.event, e.offset, e.token_ids) for e in events] == [
            (EventKind.TOKENS, 0, list(range(6))),
            (EventKind.FINISH, 6, []),
            (EventKind.TOKENS, 6, [6]),
        ]
        assert events[0].text == text_of(range(6))
        assert writer.history("r2").token_ids == list(range(6))
        client.close()


def test_history_for_a_takeover(redis_client, keys):
    a = ResponseWriter(redis_client, keys, "a")
    assert a.history("r1").final is None and a.history("r1").next_offset == 0
    for start in range(0, 5):  # one event per step, flushed after each, as an engine does
        a.add("r1", tokens_event(start, start + 1))
        a.flush()
    history = ResponseWriter(redis_client, keys, "b").history("r1")
    assert (history.token_ids, history.text, history.final) == (
        list(range(5)),
        text_of(range(5)),
        None,
    )
    a.add("r1", tokens_event(3, 6))  # overlaps: counted once
    a.add("r1", finish(6))
    a.flush()
    history = a.history("r1")
    assert history.token_ids == list(range(6)) and history.text == text_of(range(6))
    assert history.final.event == EventKind.FINISH  # finished: do not run it again


def test_history_reads_long_streams_in_chunks(redis_client, keys):
    writer = ResponseWriter(redis_client, keys, "a")
    for start in range(2500):  # one entry each: flushed one by one, not merged
        writer.add("r1", tokens_event(start, start + 1))
        writer.flush()
    assert writer.history("r1").token_ids == list(range(2500))


def test_reader_drops_what_a_dead_engine_already_sent(redis_client, keys):
    a, b = ResponseWriter(redis_client, keys, "a"), ResponseWriter(redis_client, keys, "b")
    for start in range(5):  # A sends tokens 0..4, a step at a time, and dies
        a.add("r1", tokens_event(start, start + 1))
        a.flush()
    for start in range(3, 10):  # B resumed from an older history, at offset 3
        b.add("r1", tokens_event(start, start + 1, engine="b"))
    b.add("r1", finish(10, engine="b"))
    b.flush()
    events = list(ResponseReader(redis_client, keys).events("r1", timeout=2))
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == list(range(10))
    assert "".join(e.text for e in events) == text_of(range(10))
    assert events[-1].is_final and events[-1].engine_id == "b"


def test_events_follow_a_live_writer_and_stop_at_the_final_event(redis_client, keys):
    writer = ResponseWriter(redis_client, keys, "a")

    def produce():
        for start in range(0, 6, 2):
            time.sleep(0.05)
            writer.add("r1", tokens_event(start, start + 2))
            writer.flush()
        writer.add("r1", ResponseEvent.error(ErrorCode.ENGINE_ERROR, "boom", "a", offset=6))
        writer.add("r1", tokens_event(6, 7))  # after the final event: never shown
        writer.flush()

    thread = threading.Thread(target=produce)
    thread.start()
    events = list(ResponseReader(redis_client, keys).events("r1", timeout=5))
    thread.join()
    assert [e.offset for e in events] == [0, 2, 4, 6]
    assert events[-1].error_code == ErrorCode.ENGINE_ERROR


def test_events_time_out_when_nothing_comes(redis_client, keys):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="r1"):
        list(ResponseReader(redis_client, keys).events("r1", timeout=0.3))
    assert time.monotonic() - started < 2


def test_reader_resumes_after_last_id_and_rejects_bad_events(redis_client, keys):
    writer = ResponseWriter(redis_client, keys, "a")
    writer.add("r1", tokens_event(0, 1))
    writer.flush()
    reader = ResponseReader(redis_client, keys)
    ((last_id, _),) = reader.read("r1")
    assert reader.read("r1", last_id) == []
    redis_client.xadd(keys.response_stream("r1"), {"v": "2", "kind": "event", "data": "{}"})
    with pytest.raises(ProtocolError, match="version 2"):
        reader.read("r1", last_id)


def test_input_checks(redis_client, keys):
    with pytest.raises(ValueError, match="engine_id"):
        ResponseWriter(redis_client, keys, "")
    writer = ResponseWriter(redis_client, keys, "a")
    with pytest.raises(ValueError, match="request_id"):
        writer.add("", tokens_event(0, 1))
    with pytest.raises(ValueError, match="timeout"):
        next(ResponseReader(redis_client, keys).events("r1", timeout=0))


# ------------------------------------------------------------- de-duplication


def test_partial_overlap_is_trimmed():
    dedup = ResponseDeduplicator()
    dedup.accept(tokens_event(0, 2))
    dedup.accept(tokens_event(2, 4))
    out = dedup.accept(tokens_event(2, 7))
    assert (out.offset, out.token_ids, out.text) == (4, [4, 5, 6], text_of([4, 5, 6]))
    assert dedup.accept(tokens_event(5, 6)) is None
    assert dedup.accept(ResponseEvent.tokens(3, [], "<3>", "a")) is None  # stale text only
    assert dedup.accept(finish(5)).offset == 7  # a final event always gets through
    assert dedup.accept(finish(7)) is None and dedup.done
    assert (dedup.token_ids, dedup.text) == (list(range(7)), text_of(range(7)))


def test_an_overlaps_logprobs_are_trimmed_with_its_tokens():
    def scored(start: int, end: int) -> ResponseEvent:
        entries = [
            {"token": f"<{t}>", "logprob": -t, "bytes": [], "top_logprobs": []}
            for t in range(start, end)
        ]
        return ResponseEvent.tokens(
            start, list(range(start, end)), text_of(range(start, end)), "a", entries
        )

    dedup = ResponseDeduplicator()
    dedup.accept(scored(0, 3))
    out = dedup.accept(scored(1, 5))  # an engine that resumed behind the stream
    assert out.token_ids == [3, 4] and [e["logprob"] for e in out.logprobs] == [-3, -4]


def test_overlap_from_an_unknown_text_boundary_keeps_its_text():
    dedup = ResponseDeduplicator()
    dedup.accept(tokens_event(0, 4))
    # Where token 2's text starts within "<0><1><2><3>" is unknown: repeat, never lose.
    out = dedup.accept(tokens_event(2, 6))
    assert (out.token_ids, out.text) == ([4, 5], text_of(range(2, 6)))


@st.composite
def two_writers(draw):
    """Engine A writes tokens 0..a-1, engine B resumes at an offset it read from the
    stream and writes j..n-1; their events interleave in any order that respects that."""
    a = draw(st.integers(0, 12))
    a_events = _split(draw, 0, a)
    # B read the history after A's first k events: it starts where they end.
    k = draw(st.integers(0, len(a_events)))
    j = a_events[k - 1][1] if k else 0
    n = draw(st.integers(j, 16))
    b_events = _split(draw, j, n)
    a_rest = a_events[k:]
    slots = range(len(a_rest) + len(b_events))
    # Each engine's own events stay in order; which slots are A's is drawn.
    a_slots = set(draw(st.permutations(slots))[: len(a_rest)])
    a_iter, b_iter = iter(a_rest), iter(b_events)
    merged = [next(a_iter) if i in a_slots else next(b_iter) for i in slots]
    return a_events[:k] + merged, max(a, n)


def _split(draw, start, stop):
    cuts = sorted(draw(st.sets(st.integers(start + 1, max(start + 1, stop - 1)))))
    bounds = [start, *(c for c in cuts if start < c < stop), stop]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if lo < hi]


@settings(max_examples=300, deadline=None)
@given(two_writers())
def test_overlapping_writers_never_repeat_or_lose_a_token(case):
    events, total = case
    dedup = ResponseDeduplicator()
    passed = [dedup.accept(tokens_event(lo, hi)) for lo, hi in events]
    shown = [e for e in passed if e is not None]
    assert [t for e in shown for t in e.token_ids] == list(range(total))
    assert "".join(e.text for e in shown) == text_of(range(total))
    assert dedup.next_offset == total
