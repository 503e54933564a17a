"""When a NORMAL engine prefills: the deepinfer attempt points and votes.

A NORMAL engine decodes by default. Every `prefill_attempt_interval` decode
steps (an ALL point) it prefills if every data-parallel rank wants to; every
`prefill_any_attempt_interval` steps (an ANY point) one rank wanting is
enough, so an isolated rank's prompt waits at most that long. ANY wins where
both fall. Ranks agree through all-reduce MIN votes, and because every rank
keeps the same decode-step counter, they cast the same votes in the same order
and never hang in a collective. Where no rank has anything to decode, every
step is an ANY point, and so is every step while a rank has a prompt mid-chunk
(one vote a step tells the ranks both).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from tandem.engine.config import EngineConfig

# All-reduces one int with MIN across the data-parallel ranks and returns the result.
Vote = Callable[[int], int]


class PeersLost(RuntimeError):
    """A vote's collective broke: a peer rank of the data-parallel group ended."""


class Point(Enum):
    NONE = "none"  # decode without asking anyone
    ALL = "all"  # prefill only if every rank wants to
    ANY = "any"  # prefill if any rank wants to


def _alone(value: int) -> int:
    return value


class StepVote:
    def __init__(self, config: EngineConfig, vote: Vote | None = None) -> None:
        if config.data_parallel_size > 1 and vote is None:
            raise ValueError(
                f"data_parallel_size is {config.data_parallel_size}: the scheduler needs a "
                "vote (an all-reduce MIN across the ranks) to keep step types in lockstep"
            )
        self._vote = vote or _alone
        self._all_interval = config.prefill_attempt_interval
        self._any_interval = config.prefill_any_attempt_interval
        # Without peers there is nobody to keep in lockstep.
        self.single_rank = vote is None

    def point(self, decode_step: int, *, idle: bool, mid_chunk: bool = False) -> Point:
        """The kind of attempt point at this counter value.

        A group with nothing to decode on any rank treats the step as an ANY point:
        counting empty decode steps would only delay its next prompt (~100 of them,
        seconds on an idle group). So does a group where a rank has a prompt mid-chunk
        (`mid_chunk`): a peer that decodes would vote no at the ALL point after each
        chunk, and every chunk waited for the next ANY point, 100 steps on (a single
        rank runs its chunks back to back). Several ranks learn both from one vote at
        every step, so that all of them still take the same point.
        """
        if self._forced_any(idle, mid_chunk):
            return Point.ANY
        if decode_step != 0 and decode_step % self._any_interval == 0:
            return Point.ANY
        if decode_step % self._all_interval == 0:
            return Point.ALL
        return Point.NONE

    def _forced_any(self, idle: bool, mid_chunk: bool) -> bool:
        # MIN of 0 (a prompt mid-chunk), 2 (nothing to decode) or 1 (neither): 0 if any
        # rank is mid-chunk, 2 only if every rank is idle.
        mine = 0 if mid_chunk else 2 if idle else 1
        return (mine if self.single_rank else self._vote(mine)) != 1

    def agree_to_prefill(self, point: Point, want: bool) -> bool:
        """First vote: do the ranks prefill at this point?"""
        if point is Point.ANY:
            return self._vote(0 if want else 1) == 0
        return self._vote(1 if want else 0) == 1

    def anyone_scheduled(self, scheduled: bool) -> bool:
        """Second vote: did any rank really schedule a prompt?

        `want` only saw a non-empty queue; planning can still come back empty
        (slots full, blocks short). If every rank did, the step must decode: an
        empty prompt step would reset the counter and the next step would vote
        and fail again, forever.
        """
        return self._vote(0 if scheduled else 1) == 0
