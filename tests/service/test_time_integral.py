"""TimeIntegral: the running total behind the waiting tokens' *_seconds_total counter."""

from __future__ import annotations

import itertools
import random
import threading

import pytest

from tandem.engine.service.time_integral import TimeIntegral


def test_integrates_a_value_that_changes_in_steps():
    integral = TimeIntegral(now=10.0)
    assert integral.total(15.0) == 0.0
    integral.set(100, now=15.0)
    integral.set(40, now=17.0)  # 100 for 2 s
    assert integral.total(17.0) == pytest.approx(200)
    assert integral.total(22.0) == pytest.approx(200 + 40 * 5)  # grows until read
    integral.set(0, now=23.0)
    assert integral.total(1_000.0) == pytest.approx(200 + 40 * 6)


def test_a_reading_is_history_a_late_change_starts_after_it():
    # The HTTP thread read at 10 s; the loop, whose clock said 8 s, sets 0 after.
    integral = TimeIntegral(now=0.0, value=10.0)
    assert integral.total(10.0) == pytest.approx(100)
    integral.set(0, now=8.0)
    assert integral.total(10.0) == pytest.approx(100)  # not 80: the counter never goes down
    assert integral.total(9.0) == pytest.approx(100)  # nor does a read from the past
    integral.set(5, now=12.0)
    assert integral.total(14.0) == pytest.approx(110)


def test_reads_never_go_down_whatever_the_interleaving():
    # The engine loop sets the value while the HTTP thread renders /metrics, each
    # with its own reading of the clock: any order of calls and times.
    integral, done, seen = TimeIntegral(now=0.0), threading.Event(), []
    rng = random.Random(0)
    times = [rng.uniform(0, 1_000) for _ in range(100_000)]

    def writer() -> None:
        for i, t in enumerate(sorted(times)):
            integral.set(i % 7 * 100, now=t)
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    t = 0.0
    while not done.is_set():
        t += rng.uniform(0, 0.05)
        seen.append(integral.total(t))
    thread.join()
    assert len(seen) > 10
    assert all(b >= a for a, b in itertools.pairwise(seen))


def test_a_reader_and_the_writer_never_add_the_same_span():
    # The writer is held inside its addition (its value's product waits); a
    # reader at the same time must wait for it, not add the span a second time.
    inside, entries = threading.Condition(), []

    class HeldValue(float):
        def __mul__(self, other: float) -> float:
            with inside:
                entries.append(other)
                inside.notify_all()
                inside.wait_for(lambda: len(entries) > 1, timeout=0.2)
            return float(self) * other

    integral = TimeIntegral(now=0.0, value=HeldValue(10.0))
    writer = threading.Thread(target=integral.set, args=(0.0,), kwargs={"now": 5.0})
    writer.start()
    with inside:
        assert inside.wait_for(lambda: entries, timeout=5)
    reader = threading.Thread(target=integral.total, args=(5.0,))
    reader.start()
    writer.join(5)
    reader.join(5)
    assert entries == [5.0]  # the reader found the span added, not still to add
    assert integral.total(5.0) == pytest.approx(50.0)
