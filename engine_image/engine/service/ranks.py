"""Data-parallel engine groups: one process per rank, voting through torch.distributed.

Each rank is a full engine (its own KV cache, its own Redis consumer) whose
scheduler votes with its peers on every step's type (gloo on CPU, NCCL on
CUDA), so the ranks run prefill and decode steps in lockstep.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
from collections.abc import Callable

from tandem.engine.step_vote import Vote
from tandem.parent_death import die_with
from tandem.redis_server import free_port

log = logging.getLogger("tandem.engine")

# What each rank runs (service/serve.py's serve): (args, rank, vote) -> exit code.
Serve = Callable[[argparse.Namespace, int, Vote], int]


def run_ranks(args: argparse.Namespace, serve: Serve) -> int:
    """Start data_parallel_size rank processes, each running `serve` (a module-level
    function: the spawned processes import it); forward SIGTERM/SIGINT; wait for all."""
    world = args.data_parallel_size
    port = free_port()
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch state
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(serve, args, rank, world, port, os.getpid()),
            name=f"rank-{rank}",
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()

    def forward(signum: int, _frame: object) -> None:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    # A rank that fails (a port taken, a bad device) leaves its peers blocked in a
    # collective for good: end the whole group, so the process exits and is restarted.
    while any(proc.is_alive() for proc in procs):
        multiprocessing.connection.wait([proc.sentinel for proc in procs], timeout=1.0)
        failed = [proc for proc in procs if proc.exitcode not in (None, 0)]
        if failed:
            first = failed[0]
            code = first.exitcode or 1
            how = f"signal {-code}" if code < 0 else f"code {code}"
            # Its last words may be none (SIGKILL, the OOM killer): the group's log
            # must say which rank ended it, or the pod's message says nothing.
            log.error("%s exited (%s): ending the group", first.name, how)
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            return code if code > 0 else 1
    return 0


def _rank_main(
    serve: Serve, args: argparse.Namespace, rank: int, world: int, port: int, parent: int
) -> None:
    # Killed with the group's process (a supervisor's SIGKILL forwards nothing).
    die_with(parent)
    import torch
    import torch.distributed as dist

    from tandem.engine.dp_vote import distributed_vote, vote_backend

    own_gpu = torch.cuda.is_available() and args.device in (None, "cuda")
    if own_gpu:
        args.device = f"cuda:{rank}"  # one GPU per rank, not all ranks on GPU 0
    # NCCL takes one GPU per rank: ranks that share one (an explicit --device cuda:N)
    # vote as CPU ranks do, over gloo.
    backend = vote_backend(args.device if own_gpu else None)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(args.device))  # where the vote's buffer lives
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        code = serve(args, rank, distributed_vote())
    finally:
        dist.destroy_process_group()
    raise SystemExit(code)
