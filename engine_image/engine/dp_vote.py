"""The scheduler's data-parallel vote: an all-reduce MIN of one int across ranks.

Every rank's scheduler calls its vote the same number of times in the same
order (scheduler.py), so a vote is a plain collective:

    dist.init_process_group(vote_backend(device), ...)               # one per process
    scheduler = Scheduler(config, num_blocks, vote=distributed_vote())
    votes = ThreadVote(n); Scheduler(config, num_blocks, vote=votes.vote(rank))  # in-process
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from tandem.engine.step_vote import PeersLost

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check(value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"a vote is an int, got {value!r}")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"a vote must fit in int64, got {value}")


def vote_backend(device: str | None, nccl_available: bool | None = None) -> str:
    """The torch.distributed backend for a rank on `device`: NCCL for a CUDA device
    where torch has it, else gloo."""
    if nccl_available is None:
        nccl_available = dist.is_available() and dist.is_nccl_available()
    on_gpu = device is not None and torch.device(device).type == "cuda"
    return "nccl" if on_gpu and nccl_available else "gloo"


def distributed_vote(group: dist.ProcessGroup | None = None) -> Callable[[int], int]:
    """A vote over an initialised torch.distributed group (the default group if None).

    The buffer lives where the backend reduces: on the CPU for gloo (or a
    "cpu:gloo,cuda:nccl" mix), on this process's current GPU for NCCL.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialised: "
            "call init_process_group() before distributed_vote()"
        )
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "nccl" not in backend:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    # One buffer for every round: no allocation per step.
    buffer = torch.zeros(1, dtype=torch.int64, device=device)

    def vote(value: int) -> int:
        _check(value)
        buffer.fill_(value)
        try:
            dist.all_reduce(buffer, op=dist.ReduceOp.MIN, group=group)
        # gloo's "Connection closed by peer". An NCCL collective only queues on the stream
        # and waits (in .item() below) until NCCL's watchdog times out: no PeersLost then.
        except RuntimeError as exc:
            raise PeersLost(f"a peer rank ended; the group's vote broke: {exc}") from exc
        return int(buffer.item())

    return vote


class ThreadVote:
    """n threads in one process, one per rank, each voting through vote(rank).

    A round ends when every rank has voted; all of them get the MIN. Rounds
    never mix: a rank that voted waits for the round's end before it can vote
    again, and the result is computed before anyone is released. A round
    that does not complete within `timeout` seconds (a rank stopped voting)
    raises TimeoutError in every waiting rank and breaks the vote for good.
    """

    def __init__(self, n: int, timeout: float = 30.0) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ThreadVote needs a positive number of ranks, got {n!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        self.n = n
        self.timeout = timeout
        self._lock = threading.Lock()
        self._values: list[int | None] = [None] * n
        self._result = 0
        self._round = 0
        self._barrier = threading.Barrier(n, action=self._close_round)

    def _close_round(self) -> None:
        # Runs in one thread once all n arrived, before any is released.
        self._result = min(v for v in self._values if v is not None)
        self._values = [None] * self.n
        self._round += 1

    def vote(self, rank: int) -> Callable[[int], int]:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.n:
            raise ValueError(f"rank must be in [0, {self.n}), got {rank!r}")

        def vote(value: int) -> int:
            _check(value)
            with self._lock:
                if self._barrier.broken:
                    raise TimeoutError("an earlier round of this vote timed out; it is unusable")
                if self._values[rank] is not None:
                    raise ValueError(
                        f"rank {rank} voted twice in round {self._round}: "
                        "each rank must vote from one thread at a time"
                    )
                self._values[rank] = value
                round_ = self._round
            try:
                self._barrier.wait(self.timeout)
            except threading.BrokenBarrierError:
                with self._lock:
                    missing = [r for r, v in enumerate(self._values) if v is None]
                raise TimeoutError(
                    f"vote round {round_} did not complete within {self.timeout} s: "
                    f"ranks {missing} did not vote"
                ) from None
            # Safe to read: the next round cannot end before this rank votes in it.
            return self._result

        return vote
