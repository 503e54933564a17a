"""Lockstep: the data-parallel ranks of one pod plan a step together, voting as they do.

The real scheduler votes from inside schedule() (step_vote.StepVote calls its
Vote, an all-reduce MIN, up to three times a step), so the ranks' schedule() calls
must run at the same time and meet in each vote. One thread per rank does
that here, with a barrier as the all-reduce: the scheduler code, the vote
order and the MIN are the engine's own; only the transport differs.
The simulation itself stays single-threaded: schedule_all() returns when
every rank has planned.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from tandem.engine.plan import StepPlan
from tandem.engine.scheduler import Scheduler

# Generous: a vote round takes microseconds; a stuck rank is a bug to report.
_TIMEOUT_S = 60.0


class Lockstep:
    def __init__(self, size: int) -> None:
        if size < 2:
            raise ValueError(f"lockstep needs at least 2 ranks, got {size}")
        self.size = size
        self._values = [0] * size
        self._result = 0
        self._barrier = threading.Barrier(size, action=self._close_round, timeout=_TIMEOUT_S)
        self._schedulers: Sequence[Scheduler] = ()
        self._plans: list[StepPlan | None] = [None] * size
        self._errors: list[BaseException] = []
        self._go = [threading.Semaphore(0) for _ in range(size)]
        self._done = threading.Semaphore(0)
        self._stop = False
        self._threads = [
            threading.Thread(target=self._serve, args=(rank,), daemon=True, name=f"sim-rank-{rank}")
            for rank in range(size)
        ]
        for thread in self._threads:
            thread.start()

    def vote(self, rank: int) -> Callable[[int], int]:
        """Rank `rank`'s Vote: blocks until every rank voted; returns the MIN."""

        def vote(value: int) -> int:
            self._values[rank] = value
            self._barrier.wait()
            return self._result

        return vote

    def _close_round(self) -> None:
        # Runs once per round, after every rank wrote its value, before any is released.
        self._result = min(self._values)

    def schedule_all(self, schedulers: Sequence[Scheduler]) -> list[StepPlan]:
        """Every rank's schedule(), run together; re-raises a rank's error."""
        self._schedulers = schedulers
        for go in self._go:
            go.release()
        for _ in range(self.size):
            self._done.acquire()
        if self._errors:
            error = self._errors[0]
            self._errors.clear()
            self._barrier.reset()
            raise error
        plans = [p for p in self._plans if p is not None]
        self._plans = [None] * self.size
        return plans

    def _serve(self, rank: int) -> None:
        while True:
            self._go[rank].acquire()
            if self._stop:
                return
            try:
                self._plans[rank] = self._schedulers[rank].schedule()
            except BaseException as exc:  # handed to the caller's thread
                self._errors.append(exc)
                self._barrier.abort()  # release ranks waiting in a vote
            finally:
                self._done.release()

    def close(self) -> None:
        self._stop = True
        for go in self._go:
            go.release()
        for thread in self._threads:
            thread.join(timeout=1.0)
