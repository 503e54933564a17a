"""WorkQueue against a real Redis: priorities, reclaiming, acks, counters, depth."""

import dataclasses
import threading
import time

import pytest

from tandem.backlog import TOKENS_FIELD, enqueue, queue_depth
from tandem.engine.service import work_queue
from tandem.engine.service.work_queue import Lapsed, WorkQueue
from tandem.protocol import (
    PRIORITY_HIGH,
    PRIORITY_LOW,
    PRIORITY_NORMAL,
    WORK_GROUP,
    Handoff,
    Role,
    WorkItem,
)

MODEL = "m"
IDLE_MS = 200


def item(request_id, priority=PRIORITY_NORMAL, tokens=0):
    return WorkItem(
        request_id=request_id,
        model=MODEL,
        prompt_token_ids=[1, 2, 3],
        priority=priority,
        estimated_prompt_tokens=tokens,
    )


@pytest.fixture
def queue(redis_client, keys):
    def make(consumer="e1", role=Role.NORMAL, **kwargs):
        kwargs.setdefault("claim_idle_ms", IDLE_MS)
        return WorkQueue(redis_client, keys, MODEL, role, consumer, **kwargs)

    return make


def ids(deliveries):
    return [d.request_id for d in deliveries]


def counter(redis_client, keys):
    return int(redis_client.get(keys.queued_tokens(MODEL)) or 0)


def test_higher_priorities_first_and_max_items_across_streams(redis_client, keys, queue):
    q = queue()
    for n in range(2):
        enqueue(redis_client, keys, item(f"low{n}", PRIORITY_LOW))
        enqueue(redis_client, keys, item(f"normal{n}", PRIORITY_NORMAL))
        enqueue(redis_client, keys, item(f"high{n}", PRIORITY_HIGH))
    assert ids(q.pull(1).work) == ["high0"]
    assert ids(q.pull(2).work) == ["high1", "normal0"]
    assert ids(q.pull(10).work) == ["normal1", "low0", "low1"]
    assert not q.pull(10)
    enqueue(redis_client, keys, item("x"))
    (d,) = q.pull(5).work  # a new entry: delivered once, not reclaimed
    assert (d.times_delivered, d.reclaimed, d.stream) == (1, False, keys.work_stream(MODEL, 1))


def test_ranks_of_a_group_even_out_what_they_hold(redis_client, keys, queue):
    # A data-parallel group's first rank to read took a whole burst (8 of 8), and the
    # group stepped at its pace while its peer ran empty steps.
    group = ("g", "g-r1", "g-r2")
    ranks = [queue(name, share_with=group) for name in group]
    other = queue("other-engine")  # another pod's engine, live beside the group
    for n in range(4):
        enqueue(redis_client, keys, item(f"early{n}"))
    assert len(other.pull(4).work) == 4
    for n in range(9):
        enqueue(redis_client, keys, item(f"b{n}", PRIORITY_HIGH if n % 3 == 0 else PRIORITY_LOW))
    taken = [rank.pull(256).work for rank in ranks]
    # The other holds 4, more than a share of 13 among 4: the 9 new are the group's.
    assert [len(t) for t in taken] == [3, 3, 3]
    # The others finished theirs: the rank still holding 3 takes one (never none), and
    # the two empty ones share the rest, the first to read up to the level (1.5) above.
    ranks[1].ack(taken[1])
    ranks[2].ack(taken[2])
    for n in range(4):
        enqueue(redis_client, keys, item(f"c{n}"))
    assert [len(rank.pull(256).work) for rank in ranks] == [1, 2, 1]
    with pytest.raises(ValueError, match="share_with must include the consumer"):
        queue("stranger", share_with=group)


def test_two_groups_share_a_burst_among_all_their_ranks(redis_client, keys, queue):
    # A group evened out only within itself: the first group to read took a whole burst
    # of 16 (8 a rank) while the other group's ranks sat idle.
    groups = [("a", "a-r1"), ("b", "b-r1")]
    ranks = [queue(name, share_with=group) for group in groups for name in group]
    assert not any(rank.pull(256) for rank in ranks)  # all live
    for n in range(16):
        enqueue(redis_client, keys, item(f"b{n}"))
    assert [len(rank.pull(256).work) for rank in ranks] == [4, 4, 4, 4]


def test_engines_of_a_queue_share_a_burst(redis_client, keys, queue, monkeypatch):
    # Of two decoders, the first to read took 11 of a burst of 12 and ran them on its
    # own while the other ran one: each takes its share of what the live ones hold.
    first, second = queue("engine-a"), queue("engine-b")
    assert not first.pull(256) and not second.pull(256)  # both read: live
    for n in range(12):
        enqueue(redis_client, keys, item(f"b{n}"))
    taken = [first.pull(256).work, second.pull(256).work]
    assert [len(t) for t in taken] == [6, 6]
    # One that leaves (drained, stopped) takes no share from then on: a restarted one
    # took half a burst, then one entry a pull, for as long as the old id looked live.
    second.ack(taken[1])
    second.forget_consumers(leaving=True)
    for n in range(6):
        enqueue(redis_client, keys, item(f"c{n}"))
    assert len(first.pull(256).work) == 6
    # An idle engine's pulls note it at most every LIVE_MS / 2: each note is a write.
    pullers = keys.pullers(MODEL, handoffs=False)
    noted = redis_client.zscore(pullers, "engine-a")
    assert not first.pull(256) and redis_client.zscore(pullers, "engine-a") == noted
    # A data-parallel group's ranks are noted too: a replica beside them shares with them.
    ranks = [queue(name, share_with=("g-r0", "g-r1")) for name in ("g-r0", "g-r1")]
    assert not any(rank.pull(256) for rank in ranks)
    for n in range(9):
        enqueue(redis_client, keys, item(f"d{n}"))
    # engine-a holds 12, more than a share of 21 among 4 live: the 9 new fill the three
    # others up, 3 each (a share of all, 6, left the third rank none).
    assert len(queue("replica").pull(256).work) == 3
    # One that has not pulled for LIVE_MS (full, stalled, gone) takes no share:
    # alone, an engine takes everything it has room for.
    monkeypatch.setattr(work_queue, "LIVE_MS", 1)
    time.sleep(0.01)
    for n in range(5):
        enqueue(redis_client, keys, item(f"e{n}"))
    assert len(queue("alone").pull(256).work) == 11  # the 6 left before, and these 5


def test_dead_consumer_entries_are_reclaimed_until_exhausted(redis_client, keys, queue):
    dead = queue("dead", max_deliveries=3)
    for n in range(2):
        enqueue(redis_client, keys, item(f"r{n}", tokens=5))
    assert [d.times_delivered for d in dead.pull(5).work] == [1, 1]

    survivor = queue("survivor", max_deliveries=3)
    assert not survivor.pull(5).work  # not idle long enough yet
    for times in (2, 3):
        time.sleep(IDLE_MS * 1.5 / 1000)
        pulled = queue(f"taker{times}", max_deliveries=3).pull(5)
        assert [(d.request_id, d.times_delivered, d.reclaimed) for d in pulled.work] == [
            ("r0", times, True),
            ("r1", times, True),
        ]
    time.sleep(IDLE_MS * 1.5 / 1000)
    pulled = survivor.pull(5)
    assert pulled.work == []
    assert [(d.request_id, d.times_delivered) for d in pulled.exhausted] == [("r0", 4), ("r1", 4)]
    assert all(d.exhausted for d in pulled) and len(pulled) == 2
    assert survivor.ack(pulled.exhausted) == 2
    assert redis_client.xpending(keys.work_stream(MODEL, 1), WORK_GROUP)["pending"] == 0


def test_exhausted_entries_take_no_room(redis_client, keys, queue):
    enqueue(redis_client, keys, item("old", PRIORITY_HIGH))
    queue("dead", max_deliveries=1).pull(1)
    enqueue(redis_client, keys, item("new", PRIORITY_LOW))
    time.sleep(IDLE_MS * 1.5 / 1000)
    pulled = queue("e2", max_deliveries=1).pull(1)
    assert ids(pulled.exhausted) == ["old"]
    assert ids(pulled.work) == ["new"]
    assert [(d.request_id, d.exhausted) for d in pulled] == [("new", False), ("old", True)]


def test_keep_alive_protects_entries_in_work(redis_client, keys, queue):
    worker, thief = queue("worker"), queue("thief")
    enqueue(redis_client, keys, item("long"))
    held = worker.pull(1).work
    deadline = time.monotonic() + IDLE_MS * 3 / 1000
    while time.monotonic() < deadline:
        assert worker.keep_alive(held) == Lapsed()
        assert not thief.pull(5)
        time.sleep(IDLE_MS / 4 / 1000)
    time.sleep(IDLE_MS * 1.5 / 1000)  # the worker stalls: now the entry may go
    assert ids(thief.pull(5).work) == ["long"]
    # The stalled worker learns it lost the entry and does not steal it back.
    assert worker.keep_alive(held) == Lapsed(taken=held)
    assert (
        redis_client.xpending_range(keys.work_stream(MODEL, 1), WORK_GROUP, "-", "+", 10)[0][
            "consumer"
        ]
        == b"thief"
    )


def test_ack_clears_pending_and_deletes(redis_client, keys, queue):
    q = queue()
    for n in range(3):
        enqueue(redis_client, keys, item(f"r{n}", priority=(PRIORITY_HIGH, PRIORITY_LOW)[n % 2]))
    pulled = q.pull(3).work
    assert q.ack(pulled) == 3
    assert q.ack(pulled) == 0  # idempotent
    for stream in keys.work_streams(MODEL):
        assert redis_client.xpending(stream, WORK_GROUP)["pending"] == 0
        assert redis_client.xlen(stream) == 0
    time.sleep(IDLE_MS * 1.5 / 1000)
    assert not queue("e2").pull(5)


def test_malformed_entries_are_reported_and_acked_once_answered(redis_client, keys, queue):
    q = queue()
    stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
    bad = [
        redis_client.xadd(stream, {"junk": "1"}).decode(),
        redis_client.xadd(stream, {"v": "1", "kind": "work", "data": "[1, 2]"}).decode(),
        redis_client.xadd(stream, {"v": "99", "kind": "work", "data": '{"request_id": "r9"}'}),
        redis_client.xadd(stream, {"v": "1", "kind": "work", "data": '{"request_id": "r0"}'}),
    ]
    bad = [entry_id if isinstance(entry_id, str) else entry_id.decode() for entry_id in bad]
    enqueue(redis_client, keys, item("good"))
    pulled = q.pull(10)
    assert ids(pulled.work) == ["good"]
    assert [entry_id for entry_id, _, _ in pulled.malformed] == bad
    assert "protocol version 99" in pulled.malformed[2][1]
    # Where the request id can be read, it comes along: the engine answers it.
    assert [rid for _, _, rid in pulled.malformed] == [None, None, "r9", "r0"]
    # Pending until answered: acked at once, an engine that died before its answers
    # were written left their clients waiting out their deadlines in silence.
    assert redis_client.xpending(stream, WORK_GROUP)["pending"] == 5
    assert pulled.unreadable == [(stream, entry_id) for entry_id in bad]
    assert q.ack_entries(pulled.unreadable) == 4
    assert redis_client.xpending(stream, WORK_GROUP)["pending"] == 1  # only the good one
    time.sleep(IDLE_MS * 1.5 / 1000)
    assert ids(queue("e2").pull(10).work) == ["good"]  # the bad ones never come back


def test_entry_deleted_while_pending_is_dropped(redis_client, keys, queue):
    enqueue(redis_client, keys, item("gone"))
    (d,) = queue("dead").pull(1).work
    redis_client.xdel(d.stream, d.entry_id)
    time.sleep(IDLE_MS * 1.5 / 1000)
    pulled = queue("e2").pull(5)
    assert [entry_id for entry_id, _, _ in pulled.malformed] == [d.entry_id]
    assert redis_client.xpending(d.stream, WORK_GROUP)["pending"] == 0


def test_queued_tokens_counter(redis_client, keys, queue):
    enqueue(redis_client, keys, item("a", PRIORITY_HIGH, tokens=10))
    enqueue(redis_client, keys, item("b", PRIORITY_NORMAL, tokens=20))
    enqueue(redis_client, keys, item("c", PRIORITY_LOW, tokens=0))
    assert counter(redis_client, keys) == 30
    queue("dead").pull(1)
    assert counter(redis_client, keys) == 20
    time.sleep(IDLE_MS * 1.5 / 1000)
    assert ids(queue("e2").pull(1).work) == ["a"]  # the reclaim: no second decrement
    assert counter(redis_client, keys) == 20
    redis_client.set(keys.queued_tokens(MODEL), 5)  # e.g. a counter reset under load
    queue("e3").pull(5)
    assert counter(redis_client, keys) == 0
    # An entry some other producer added without counting subtracts nothing.
    enqueue(redis_client, keys, item("d", tokens=7))
    redis_client.xadd(keys.work_stream(MODEL, 1), item("e", tokens=50).to_fields())
    queue("e3").pull(5)
    assert counter(redis_client, keys) == 0
    assert TOKENS_FIELD not in item("e").to_fields()


def test_queue_depth(redis_client, keys, queue):
    for n in range(3):
        enqueue(redis_client, keys, item(f"n{n}", PRIORITY_NORMAL, tokens=4))
    enqueue(redis_client, keys, item("h", PRIORITY_HIGH, tokens=4))
    before = queue_depth(redis_client, keys, MODEL)  # no engine yet: no groups
    assert before.waiting == {PRIORITY_HIGH: 1, PRIORITY_NORMAL: 3, PRIORITY_LOW: 0}
    assert (before.pending, before.queued_tokens, before.total_waiting) == (0, 16, 4)
    q = queue()
    taken = q.pull(2).work
    state = queue_depth(redis_client, keys, MODEL)
    assert state.waiting == {PRIORITY_HIGH: 0, PRIORITY_NORMAL: 2, PRIORITY_LOW: 0}
    assert (state.pending, state.queued_tokens) == (2, 8)
    q.ack(taken[:1])
    state = queue_depth(redis_client, keys, MODEL)
    assert (state.total_waiting, state.pending) == (2, 1)
    assert (state.handoff_waiting, state.handoff_pending) == (0, 0)


def handoff(request_id):
    return Handoff(
        work=dataclasses.asdict(item(request_id)),
        prompt_token_ids=[1, 2, 3],
        first_token_ids=[4],
        kv_address="127.0.0.1:1",
        kv_handle="h",
        num_kv_tokens=3,
        fingerprint="f",
        prompt_engine="p1",
        expires_at=time.time() + 60,
    )


def prefilled(redis_client, keys, prompt, request_id):
    """The work entry of `request_id`, pulled by the PROMPT engine queue `prompt`."""
    enqueue(redis_client, keys, item(request_id))
    (delivery,) = prompt.pull(1).work
    return delivery


def test_handoffs_go_to_completion_engines(redis_client, keys, queue):
    prompt = queue("p1", role=Role.PROMPT)
    completion = queue("c1", role=Role.COMPLETION)
    source = prefilled(redis_client, keys, prompt, "r1")
    assert prompt.publish_handoff(handoff("r1"), source)
    depth = queue_depth(redis_client, keys, MODEL)
    assert depth.handoff_waiting == 1
    assert (depth.total_waiting, depth.pending) == (0, 0), "its work entry acknowledged"
    (d,) = completion.pull(4).work
    assert isinstance(d.message, Handoff)
    assert (d.request_id, d.stream) == ("r1", keys.handoff_stream(MODEL))
    assert not prompt.pull(4)  # prompt engines read the work streams only
    assert queue_depth(redis_client, keys, MODEL).handoff_pending == 1
    completion.ack([d])
    assert queue_depth(redis_client, keys, MODEL).handoff_pending == 0


def test_handoffs_keep_their_priority_and_the_backlog_counts_them_all(redis_client, keys, queue):
    prompt = queue("p1", role=Role.PROMPT)
    completion = queue("c1", role=Role.COMPLETION)
    for rid, priority in (("low", PRIORITY_LOW), ("normal", PRIORITY_NORMAL)):
        enqueue(redis_client, keys, item(rid, priority))
        (source,) = prompt.pull(1).work
        work = dataclasses.asdict(item(rid, priority))
        assert prompt.publish_handoff(dataclasses.replace(handoff(rid), work=work), source)
    enqueue(redis_client, keys, item("high", PRIORITY_HIGH))
    (source,) = prompt.pull(1).work
    work = dataclasses.asdict(item("high", PRIORITY_HIGH))
    assert prompt.publish_handoff(dataclasses.replace(handoff("high"), work=work), source)
    assert queue_depth(redis_client, keys, MODEL).handoff_waiting == 3
    taken = completion.pull(3).work
    assert [d.request_id for d in taken] == ["high", "normal", "low"]
    assert taken[0].stream == keys.handoff_stream(MODEL, PRIORITY_HIGH)
    assert queue_depth(redis_client, keys, MODEL).handoff_pending == 3


def test_a_priority_no_decoder_reads_yet_is_offered_on_the_normal_stream(redis_client, keys, queue):
    # Through a rolling upgrade the decoders may all be of a version with one handoff
    # stream (normal's name): a high handoff on a stream they never read was stuck.
    prompt = queue("p1", role=Role.PROMPT)
    high = dataclasses.asdict(item("r1", PRIORITY_HIGH))
    enqueue(redis_client, keys, item("r1", PRIORITY_HIGH))
    (source,) = prompt.pull(1).work
    assert prompt.publish_handoff(dataclasses.replace(handoff("r1"), work=high), source)
    assert redis_client.xlen(keys.handoff_stream(MODEL)) == 1
    assert not redis_client.exists(keys.handoff_stream(MODEL, PRIORITY_HIGH))
    queue("c1", role=Role.COMPLETION)  # a decoder of this version: all three streams
    enqueue(redis_client, keys, item("r2", PRIORITY_HIGH))
    (source,) = prompt.pull(1).work
    high = dataclasses.asdict(item("r2", PRIORITY_HIGH))
    assert prompt.publish_handoff(dataclasses.replace(handoff("r2"), work=high), source)
    assert redis_client.xlen(keys.handoff_stream(MODEL, PRIORITY_HIGH)) == 1


def test_a_handoff_is_published_once_and_only_by_the_entrys_holder(redis_client, keys, queue):
    stalled, thief = queue("p1", role=Role.PROMPT), queue("p2", role=Role.PROMPT)
    source = prefilled(redis_client, keys, stalled, "r1")
    assert stalled.publish_handoff(handoff("r1"), source)
    # A retry after a lost reply (the publish was written): published, once.
    assert stalled.publish_handoff(handoff("r1"), source)
    assert redis_client.xlen(keys.handoff_stream(MODEL)) == 1
    assert not thief.publish_handoff(handoff("r1"), source), "another engine's, not its own"

    late = prefilled(redis_client, keys, stalled, "r2")
    time.sleep(IDLE_MS * 1.5 / 1000)  # it stalls; another engine takes the entry over
    assert ids(thief.pull(1).work) == ["r2"]
    assert not stalled.publish_handoff(handoff("r2"), late)
    assert redis_client.xlen(keys.handoff_stream(MODEL)) == 1

    lost = prefilled(redis_client, keys, stalled, "r3")
    redis_client.delete(*keys.work_streams(MODEL))  # Redis lost its data: nobody else has it
    assert stalled.publish_handoff(handoff("r3"), lost)
    assert redis_client.xlen(keys.handoff_stream(MODEL)) == 2


def test_handoff_with_a_bad_work_item_is_malformed(redis_client, keys, queue):
    prompt = queue("p1", role=Role.PROMPT)
    completion = queue("c1", role=Role.COMPLETION)
    bad = handoff("r1")
    bad.work = {"model": MODEL}  # no request_id, no prompt
    assert prompt.publish_handoff(bad, prefilled(redis_client, keys, prompt, "r1"))
    ((entry_id, _),) = redis_client.xrange(keys.handoff_stream(MODEL))
    pulled = completion.pull(4)
    assert pulled.work == [] and [e for e, _, _ in pulled.malformed] == [entry_id.decode()]


def test_pull_blocks_until_work_arrives(redis_client, keys, queue):
    q = queue()
    started = time.monotonic()
    assert not q.pull(3, block_ms=200)
    assert 0.15 < time.monotonic() - started < 1.5
    timer = threading.Timer(0.2, enqueue, (redis_client, keys, item("late", PRIORITY_LOW)))
    timer.start()
    started = time.monotonic()
    assert ids(q.pull(3, block_ms=5000).work) == ["late"]
    assert time.monotonic() - started < 2
    timer.join()


def test_groups_come_back_after_the_streams_vanish(redis_client, keys, queue):
    q = queue()
    redis_client.delete(*keys.work_streams(MODEL))
    enqueue(redis_client, keys, item("after"))
    assert ids(q.pull(3).work) == ["after"]


def test_input_checks(redis_client, keys, queue):
    q = queue()
    with pytest.raises(ValueError, match="max_items"):
        q.pull(0)
    with pytest.raises(ValueError, match="block_ms"):
        q.pull(1, block_ms=-1)
    with pytest.raises(ValueError):
        queue(role="decoder")
    with pytest.raises(ValueError, match="max_deliveries"):
        queue(max_deliveries=0)
    with pytest.raises(ValueError, match="estimated_prompt_tokens"):
        enqueue(redis_client, keys, item("r", tokens=-1))
    bad_priority = item("r")
    bad_priority.priority = 7
    with pytest.raises(ValueError, match="priority"):
        enqueue(redis_client, keys, bad_priority)


def test_keep_alive_after_the_streams_vanish_loses_nothing(redis_client, keys, queue):
    q = queue()
    enqueue(redis_client, keys, item("r"))
    held = q.pull(1).work
    redis_client.delete(*keys.work_streams(MODEL))  # Redis lost its data
    assert q.keep_alive(held) == Lapsed()  # nobody else can take them: keep serving
    assert q.ack(held) == 0


def test_keep_alive_tells_taken_entries_from_ones_pending_nowhere(redis_client, keys, queue):
    worker, thief = queue("worker"), queue("thief")
    for rid in ("stolen", "finished", "lost"):
        enqueue(redis_client, keys, item(rid))
    held = worker.pull(3).work
    time.sleep(IDLE_MS * 1.5 / 1000)  # the worker stalls
    _, finished = thief.pull(2).work
    thief.ack([finished])  # the thief finished one
    stream = keys.work_stream(MODEL, 1)
    # Redis lost the third (restarted without it); its group is back.
    redis_client.xack(stream, WORK_GROUP, held[2].entry_id)
    lapsed = worker.keep_alive(held)
    assert ids(lapsed.taken) == ["stolen"]
    # Finished elsewhere or lost: the engine tells them apart by the response stream.
    assert ids(lapsed.gone) == ["finished", "lost"]


def test_a_handed_back_entry_is_taken_at_once_and_not_counted(redis_client, keys, queue):
    # A drain that timed out hands its entries back: the next pull takes them without
    # waiting out claim_idle_ms, and the handed-back delivery is no failed one.
    leaving = queue("leaving", claim_idle_ms=30_000)
    enqueue(redis_client, keys, item("r"))
    held = leaving.pull(1).work
    assert leaving.hand_back(held) == 1
    successor = queue("successor", claim_idle_ms=30_000, max_deliveries=1)
    (taken,) = successor.pull(5).work  # not exhausted, though max_deliveries is 1
    assert (taken.request_id, taken.times_delivered, taken.reclaimed) == ("r", 1, True)
    assert leaving.hand_back(held) == 0  # not its own any more: left alone
    assert successor.keep_alive([taken]) == Lapsed()


def test_a_dead_predecessors_entries_are_released_at_start_and_counted(redis_client, keys, queue):
    # An engine restarted under its id finds its predecessor's entries pending under
    # that id: it hands them back before its first pull instead of waiting out
    # claim_idle_ms, and the delivery that died counts (it may have died of it).
    dead = queue("engine-a", claim_idle_ms=30_000)
    other = queue("engine-b", claim_idle_ms=30_000)
    for rid in ("r1", "r2", "r3"):
        enqueue(redis_client, keys, item(rid))
    assert ids(dead.pull(2).work) == ["r1", "r2"]
    assert ids(other.pull(1).work) == ["r3"]
    restarted = queue("engine-a", claim_idle_ms=30_000, max_deliveries=2)
    assert restarted.pull(5).work == []  # without the release: 30 s of nothing
    assert restarted.release_inherited() == 2
    taken = restarted.pull(5).work
    assert [(d.request_id, d.times_delivered, d.reclaimed) for d in taken] == [
        ("r1", 2, True),
        ("r2", 2, True),
    ]
    # What it holds now is its own work, not an inheritance; engine-b's entry is untouched.
    assert restarted.keep_alive(taken) == Lapsed()
    assert queue("engine-c", claim_idle_ms=30_000).pull(5).work == []
    # Released again (a second crash), r1 is past max_deliveries: reported, not run.
    assert queue("engine-a", max_deliveries=2).release_inherited() == 2
    assert ids(queue("engine-c", max_deliveries=2).pull(5).exhausted) == ["r1", "r2"]


def test_releasing_with_nothing_inherited_is_a_no_op(redis_client, keys, queue):
    assert queue("fresh", role=Role.COMPLETION).release_inherited() == 0
    assert queue("fresh").release_inherited() == 0


def consumers(redis_client, keys):
    stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
    return sorted(c["name"].decode() for c in redis_client.xinfo_consumers(stream, WORK_GROUP))


def test_engines_gone_with_nothing_pending_leave_the_group(redis_client, keys, queue):
    # Pods come and go under new ids; each one that took work is a consumer of the group.
    for rid in ("r1", "r2", "r3"):
        enqueue(redis_client, keys, item(rid))
    busy, done, leaving = queue("busy"), queue("done"), queue("leaving")
    assert ids(busy.pull(1).work) == ["r1"]
    done.ack(done.pull(1).work)
    leaving.ack(leaving.pull(1).work)
    assert consumers(redis_client, keys) == ["busy", "done", "leaving"]
    # Leaving (its drain done): itself at once, not the others, idle or not...
    assert leaving.forget_consumers(leaving=True) == 1
    assert consumers(redis_client, keys) == ["busy", "done"]
    # ...and never one with entries pending: they would no longer be reclaimable.
    assert busy.forget_consumers(leaving=True) == 0
    time.sleep(IDLE_MS / 1000 + 0.05)
    # Past claim_idle_ms idle, any engine's sweep deletes consumers with nothing pending.
    assert queue("sweeper").forget_consumers() == 1
    assert consumers(redis_client, keys) == ["busy"]
    # A swept engine that lives after all reads on: its next pull adds it back (and
    # the idle busy entry is still reclaimable from the group).
    enqueue(redis_client, keys, item("r4"))
    assert ids(done.pull(5).work) == ["r1", "r4"]
    assert consumers(redis_client, keys) == ["busy", "done"]


def test_entries_a_lost_pull_took_are_released_uncounted_and_known_ones_kept(
    redis_client, keys, queue
):
    # Redis ran the pull, then the connection broke: the entry was pending here, under
    # no request the engine knew, for the whole claim_idle_ms.
    engine = queue("engine-a", claim_idle_ms=30_000, max_deliveries=1)
    for rid in ("held", "lost"):
        enqueue(redis_client, keys, item(rid))
    held, _lost_reply = engine.pull(2).work
    assert engine.release_strays([held]) == 1
    (taken,) = queue("engine-b", claim_idle_ms=30_000, max_deliveries=1).pull(5).work
    assert (taken.request_id, taken.times_delivered, taken.exhausted) == ("lost", 1, False)
    assert engine.keep_alive([held]) == Lapsed(), "the one it knows stays its own"


def test_a_share_counts_a_peer_by_its_last_pull_and_no_error_replies_as_work(
    redis_client, keys, queue, monkeypatch
):
    # A pull notes its time at most every LIVE_MS / 2: an engine that pulled 0.6 s ago
    # read as gone once its note was a whole LIVE_MS old, and a peer took a whole burst.
    monkeypatch.setattr(work_queue, "LIVE_MS", 1000)
    first, second = queue("engine-a"), queue("engine-b")
    assert not first.pull(256)  # noted
    time.sleep(0.45)
    assert not first.pull(256)  # not noted again: its note is recent
    time.sleep(0.6)
    for n in range(4):
        enqueue(redis_client, keys, item(f"b{n}"))
    assert len(second.pull(256).work) == 2


def test_error_replies_reclaimed_take_no_share_of_new_work(redis_client, keys, queue):
    # Entries reclaimed past max_deliveries are errors to send, not work: they took the
    # pull's share down to its floor of one.
    dead, third = queue("dead", max_deliveries=1), queue("engine-c", max_deliveries=1)
    for n in range(4):
        enqueue(redis_client, keys, item(f"z{n}"))
    assert len(dead.pull(256).work) == 4  # then it dies, holding them
    pullers = keys.pullers(MODEL, handoffs=False)
    redis_client.zrem(pullers, "dead")
    time.sleep(IDLE_MS / 1000 + 0.05)
    for n in range(4):
        enqueue(redis_client, keys, item(f"w{n}"))
    redis_client.zadd(pullers, {"engine-d": int(time.time() * 1000)})  # live, holding none
    pulled = third.pull(256)
    assert (len(pulled.exhausted), len(pulled.work)) == (4, 2)
