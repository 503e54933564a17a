"""The prefill queue's order: priority, then arrival; a prompt mid-chunk stays first."""

from tandem.engine.request import Request
from tandem.engine.waiting_queue import WaitingQueue


def queue_of(mid_chunk=()):
    return WaitingQueue(lambda request_id: request_id in mid_chunk)


def request(rid, priority=0):
    made = Request(rid, [1, 2, 3])
    made.priority = priority
    return made


def ids(queue):
    return [r.request_id for r in queue]


def test_higher_priority_first_then_arrival():
    queue = queue_of()
    for rid, priority in [("a", 0), ("b", 1), ("c", 0), ("d", 1), ("e", 2)]:
        queue.add(request(rid, priority))
    assert ids(queue) == ["e", "b", "d", "a", "c"]
    assert queue.first().request_id == "e" and queue.pop_first().request_id == "e"


def test_nothing_goes_ahead_of_a_prompt_mid_chunk():
    queue = queue_of(mid_chunk={"chunked"})
    queue.add(request("chunked", priority=0))
    queue.add(request("urgent", priority=2))
    queue.add_first(request("recompute"))
    assert ids(queue) == ["chunked", "recompute", "urgent"]


def test_a_recompute_first_keeps_arrival_order_within_a_priority_behind_it():
    # A new request went in before the first entry of lower priority, the recompute at
    # the front: "b" jumped ahead of "a" of its own priority, and of the recompute.
    queue = queue_of()
    queue.add_first(request("recompute", priority=0))
    queue.add(request("a", priority=2))
    queue.add(request("c", priority=0))
    queue.add(request("b", priority=2))
    assert ids(queue) == ["recompute", "a", "b", "c"]
    queue.pop_first()
    queue.add(request("d", priority=3))  # the recompute gone: nothing holds the front
    assert ids(queue) == ["d", "a", "b", "c"]


def test_an_empty_queue_has_no_first():
    queue = queue_of()
    assert queue.first() is None and not queue and len(queue) == 0
