"""StepVote alone: attempt points and the meaning of the two votes."""

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.step_vote import Point, StepVote


def test_points_follow_the_intervals_and_any_wins_where_both_fall():
    votes = StepVote(
        EngineConfig(prefill_attempt_interval=50, prefill_any_attempt_interval=100),
        vote=lambda v: v,
    )
    assert votes.point(0, idle=False) is Point.ALL  # right after a prompt step
    assert votes.point(1, idle=False) is Point.NONE
    assert votes.point(50, idle=False) is Point.ALL
    assert votes.point(100, idle=False) is Point.ANY
    assert votes.point(150, idle=False) is Point.ALL
    assert votes.point(200, idle=False) is Point.ANY


def peer(*, idle: bool = False, mid_chunk: bool = False) -> StepVote:
    """This rank's votes beside one peer in the given state: the MIN of this rank's
    ballot and the one the peer's own StepVote casts at the point."""
    return StepVote(EngineConfig(), vote=lambda mine: min(mine, _cast(idle, mid_chunk)))


def _cast(idle: bool, mid_chunk: bool) -> int:
    """The peer's vote at a step's point, cast by a StepVote of its own."""
    cast = []
    StepVote(EngineConfig(), vote=lambda v: cast.append(v) or v).point(
        37, idle=idle, mid_chunk=mid_chunk
    )
    return cast[0]


def test_an_idle_group_may_prefill_at_any_step_a_busy_one_at_its_points():
    alone = StepVote(EngineConfig())
    assert alone.point(37, idle=True) is Point.ANY
    assert alone.point(37, idle=False) is Point.NONE
    # Several ranks: ANY only when no rank decodes.
    assert peer(idle=True).point(37, idle=True) is Point.ANY
    assert peer(idle=True).point(37, idle=False) is Point.NONE
    assert peer(idle=False).point(37, idle=True) is Point.NONE
    assert peer(idle=False).point(100, idle=True) is Point.ANY


@pytest.mark.parametrize("idle", [True, False])
def test_a_prompt_mid_chunk_on_any_rank_makes_every_step_an_any_point(idle):
    # A peer decoding votes no at the ALL point after each chunk: the next chunk
    # waited for the ANY point, 100 decode steps on.
    assert StepVote(EngineConfig()).point(37, idle=idle, mid_chunk=True) is Point.ANY
    assert peer(mid_chunk=True).point(37, idle=idle) is Point.ANY
    assert peer(idle=idle).point(37, idle=False, mid_chunk=True) is Point.ANY
    assert peer(idle=True).point(37, idle=True, mid_chunk=True) is Point.ANY


@pytest.mark.parametrize(
    ("point", "peer_vote", "want", "expected"),
    [
        (Point.ALL, 1, True, True),  # every rank wants
        (Point.ALL, 0, True, False),  # a peer does not
        (Point.ANY, 0, False, True),  # a peer wants (votes 0 at ANY)
        (Point.ANY, 1, False, False),  # nobody wants
        (Point.ANY, 1, True, True),  # this rank wants
    ],
)
def test_first_vote_all_needs_everyone_any_needs_one(point, peer_vote, want, expected):
    votes = StepVote(EngineConfig(), vote=lambda mine: min(mine, peer_vote))
    assert votes.agree_to_prefill(point, want) is expected


def test_second_vote_is_true_when_any_rank_scheduled():
    assert StepVote(EngineConfig(), vote=lambda mine: min(mine, 0)).anyone_scheduled(False)
    assert not StepVote(EngineConfig(), vote=lambda mine: min(mine, 1)).anyone_scheduled(False)


def test_several_ranks_need_a_vote():
    with pytest.raises(ValueError, match="needs a vote"):
        StepVote(EngineConfig(data_parallel_size=2))
