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


def test_an_idle_group_may_prefill_at_any_step_a_busy_one_at_its_points():
    alone = StepVote(EngineConfig())
    assert alone.point(37, idle=True) is Point.ANY
    assert alone.point(37, idle=False) is Point.NONE
    # Several ranks: ANY only when no rank decodes (the vote is the MIN of "idle").
    everyone_idle = StepVote(EngineConfig(), vote=lambda mine: min(mine, 1))
    assert everyone_idle.point(37, idle=True) is Point.ANY
    assert everyone_idle.point(37, idle=False) is Point.NONE
    a_peer_decodes = StepVote(EngineConfig(), vote=lambda mine: min(mine, 0))
    assert a_peer_decodes.point(37, idle=True) is Point.NONE
    assert a_peer_decodes.point(100, idle=True) is Point.ANY


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
