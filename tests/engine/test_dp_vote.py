"""The data-parallel vote: gloo across real processes, ThreadVote across threads;
NCCL chosen for ranks on CUDA (no GPU here: the choice is what is tested)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from tandem.engine.dp_vote import ThreadVote, distributed_vote, vote_backend
from tandem.redis_server import free_port

WORKER = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    from tandem.engine.dp_vote import distributed_vote

    port, rank, values = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
    )
    vote = distributed_vote()
    print(json.dumps([vote(v) for v in values]))
    dist.destroy_process_group()
    """
)


def test_distributed_vote_takes_the_min_across_two_processes():
    values = [[5, -3, 10, 0, 2**40, 1], [7, 4, -8, 0, 1, 1]]
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, port, str(rank), json.dumps(values[rank])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    expected = [min(a, b) for a, b in zip(*values, strict=True)]
    assert outputs == [expected, expected]


@pytest.mark.parametrize(
    ("device", "nccl", "backend"),
    [
        (None, True, "gloo"),
        ("cpu", True, "gloo"),
        ("cuda:1", True, "nccl"),
        ("cuda", True, "nccl"),
        ("cuda:0", False, "gloo"),  # a torch built without NCCL
    ],
)
def test_ranks_on_cuda_vote_over_nccl(device, nccl, backend):
    assert vote_backend(device, nccl_available=nccl) == backend


def test_distributed_vote_needs_an_initialised_group():
    with pytest.raises(ValueError, match="init_process_group"):
        distributed_vote()


def run_ranks(votes: ThreadVote, body) -> list[BaseException]:
    """Run body(rank, vote) in one thread per rank; return what they raised."""
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            body(rank, votes.vote(rank))
        except BaseException as error:  # collected for the main thread
            errors.append(error)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(votes.n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


def test_thread_vote_three_ranks_thousand_rounds():
    votes = ThreadVote(3)

    def value(rank: int, round_: int) -> int:
        return (round_ * 7919 + rank * 104729) % 11 - 5

    def body(rank, vote):
        for round_ in range(1000):
            got = vote(value(rank, round_))
            expected = min(value(r, round_) for r in range(3))
            if got != expected:
                raise AssertionError(f"rank {rank} round {round_}: {got} != {expected}")

    assert run_ranks(votes, body) == []


def test_thread_vote_single_rank_is_identity():
    vote = ThreadVote(1).vote(0)
    assert [vote(3), vote(-2)] == [3, -2]


def test_a_rank_that_stops_voting_times_out_every_waiter():
    votes = ThreadVote(3, timeout=0.3)

    def body(rank, vote):
        if rank < 2:  # rank 2 never votes
            vote(1)

    errors = run_ranks(votes, body)
    assert len(errors) == 2
    assert all(isinstance(e, TimeoutError) and "ranks [2]" in str(e) for e in errors)
    with pytest.raises(TimeoutError, match="unusable"):
        votes.vote(2)(0)


def test_a_rank_cannot_vote_twice_in_one_round():
    votes = ThreadVote(2, timeout=10)
    results: list[int] = []
    first = threading.Thread(target=lambda: results.append(votes.vote(0)(4)))
    first.start()
    while votes._values[0] is None:  # wait until rank 0's vote is in
        threading.Event().wait(0.001)
    with pytest.raises(ValueError, match="voted twice"):
        votes.vote(0)(1)
    assert votes.vote(1)(9) == 4
    first.join(timeout=10)
    assert results == [4]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive"):
        ThreadVote(0)
    votes = ThreadVote(2)
    with pytest.raises(ValueError, match="rank"):
        votes.vote(2)
    with pytest.raises(ValueError, match="int"):
        votes.vote(0)(1.5)
    with pytest.raises(ValueError, match="int64"):
        votes.vote(0)(2**63)
