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
import sys
import time
from collections.abc import Callable, Mapping

from tandem.cpu_cores import usable_cores
from tandem.engine.step_vote import PeersLost, Vote
from tandem.parent_death import die_with
from tandem.redis_server import free_port

log = logging.getLogger("tandem.engine")

# What each rank runs (service/serve.py's serve): (args, rank, vote) -> exit code.
Serve = Callable[[argparse.Namespace, int, Vote], int]

# Past --drain-timeout, how long the ranks get to stop (hand back, close) before the
# group kills them: below the pod's grace beyond the drain (manifests_pods.py's 30 s),
# so that the log says which rank hung rather than the kubelet's SIGKILL saying nothing.
STOP_MARGIN_S = 15.0
# After a rank failed, how long its peers get to exit on their own: their next vote
# breaks, and they hand back what they hold (killed at once, their requests waited
# --claim-idle-ms for a takeover).
PEERS_HAND_BACK_S = 10.0
# How a rank exits once its vote broke because a peer ended: the group names the
# ranks that ended otherwise, the failure's cause, not the first one reaped.
PEER_ENDED_CODE = 3


def run_ranks(args: argparse.Namespace, serve: Serve) -> int:
    """Start data_parallel_size rank processes, each running `serve` (a module-level
    function: the spawned processes import it); forward SIGTERM/SIGINT; wait for all."""
    world = args.data_parallel_size
    if (threads := rank_threads(args.threads, world, os.environ)) != args.threads:
        args.threads = threads
        log.info("each rank runs on %d CPU thread(s) (--threads to choose)", threads)
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
    # The ranks start with SIGINT ignored (inherited; Python then leaves it so), and
    # the group stops them with SIGTERM: a terminal's Ctrl-C reaches every rank too, and
    # raised KeyboardInterrupt in their imports or a C++ call (tracebacks, an abort),
    # read as a failed rank. Until serve() takes SIGTERM (a drain) once loaded, a rank
    # dies of it, which the group counts as stopped.
    asked: list[float] = []  # when the group was asked to stop

    def forward(_signum: int, _frame: object) -> None:
        asked.append(time.monotonic())
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    # SIGTERM is taken before the ranks start (a rank's exec resets a handler to the
    # default): one that came between the last start and the handler killed the group.
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for proc in procs:
        if asked:  # asked to stop while starting: the ranks not started never are
            break
        proc.start()
    procs = [proc for proc in procs if proc.pid is not None]
    if asked:  # a rank starting as the signal came is told now (a drain asked twice is one)
        forward(signal.SIGTERM, None)
    signal.signal(signal.SIGINT, forward)
    # A rank that fails (a port taken, a bad device) leaves its peers blocked in a
    # collective for good: end the whole group, so the process exits and is restarted.
    # Taken as they end: the first to fail is named, not a peer that failed after it
    # (its collective broken: "Connection closed by peer").
    running = {proc.sentinel: proc for proc in procs}
    while running:
        ready = multiprocessing.connection.wait(list(running), timeout=1.0)
        ended = [running.pop(sentinel) for sentinel in ready]
        for proc in ended:
            proc.join()  # its sentinel may be ready a moment before its exit code
        # A rank ended by the signal forwarded to it (one still loading, whose handler
        # is not set yet) stopped as asked.
        stopped = (0, -signal.SIGTERM) if asked else (0,)
        failed = [proc for proc in ended if proc.exitcode not in stopped]
        if failed:
            return _end_group(procs, failed, stopped)
        limit = args.drain_timeout + STOP_MARGIN_S
        if running and asked and time.monotonic() > asked[0] + limit:
            # A rank stuck in a step or a vote (a hung kernel, a peer stopped) never
            # reads its drain flag: the group would wait for the kubelet's SIGKILL.
            hung = ", ".join(proc.name for proc in running.values())
            log.error("%s did not stop within %.0f s of the signal: killing the group", hung, limit)
            _kill(procs)
            return 1
    return 0


def _end_group(
    procs: list[multiprocessing.process.BaseProcess],
    failed: list[multiprocessing.process.BaseProcess],
    stopped: tuple[int, ...],
) -> int:
    """Name the ranks that failed and kill what is left; the group's exit code."""
    causes = [proc for proc in failed if proc.exitcode != PEER_ENDED_CODE]
    if not causes:
        # A peer saw the broken vote before the failed rank was reaped (its sockets
        # close as it exits): wait for that one, the one to name.
        deadline = time.monotonic() + PEERS_HAND_BACK_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        ended = [proc for proc in procs if proc.exitcode not in (None, *stopped)]
        causes = [proc for proc in ended if proc.exitcode != PEER_ENDED_CODE] or failed
    # Its last words may be none (SIGKILL, the OOM killer): the group's log must say
    # which rank ended it, or the pod's message says nothing. Those that ended
    # together are all named: which failed first is not known then.
    said = ", ".join(f"{proc.name} exited ({_how(proc.exitcode)})" for proc in causes)
    log.error("%s: ending the group", said)
    _kill(procs, grace_s=PEERS_HAND_BACK_S)
    code = causes[0].exitcode or 1
    return code if code > 0 else 1


def _kill(procs: list[multiprocessing.process.BaseProcess], grace_s: float = 0.0) -> None:
    """Kill the ranks still running after `grace_s` seconds."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
        proc.join()


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


def _rank_main(
    serve: Serve, args: argparse.Namespace, rank: int, world: int, port: int, parent: int
) -> None:
    # Killed with the group's process (a supervisor's SIGKILL forwards nothing).
    die_with(parent)
    import torch
    import torch.distributed as dist

    from tandem.engine.dp_vote import distributed_vote, vote_backend

    try:
        device = rank_device(args.device, rank)
    except ValueError as exc:  # more ranks than GPUs: before CUDA's "invalid device ordinal"
        print(f"tandem: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    own_gpu = device != args.device
    args.device = device
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
    except ValueError as exc:  # bad flags found once the model loaded: as one rank says it
        print(f"tandem: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except PeersLost:  # the group names the rank that failed; this one handed back
        log.warning("rank-%d: a peer rank ended; stopping with the group", rank)
        # Not through the interpreter's exit: gloo's group, its peer gone, aborts in
        # its destructor ("terminate called without an active exception", SIGABRT),
        # which the group would read as this rank failing.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(PEER_ENDED_CODE)
    # Only after a clean run: a rank that fails keeps its connections until it has exited,
    # so its peers, whose collectives break only then, never exit first in its stead.
    dist.destroy_process_group()
    raise SystemExit(code)


def rank_threads(threads: int | None, world: int, environ: Mapping[str, str]) -> int | None:
    """CPU threads for each of `world` ranks: `threads` (--threads) where given, else
    the usable cores shared out; None where OMP_NUM_THREADS says (torch reads it).
    Each rank took every core torch sees: 2 ranks on 2 cores ran 4-8x slower."""
    if threads is not None or "OMP_NUM_THREADS" in environ:
        return threads
    return max(1, usable_cores() // world)


def rank_device(device: str | None, rank: int) -> str | None:
    """The device rank `rank` runs on: its own GPU, cuda:<rank>, where the host has CUDA
    and --device named no one GPU (not every rank on GPU 0), else `device`. ValueError
    where the host has fewer GPUs than that (the loader's words, which name the fix)."""
    import torch

    from tandem.engine.model.loader import pick_device

    if not (torch.cuda.is_available() and device in (None, "cuda")):
        return device
    own = f"cuda:{rank}"
    pick_device(own)
    return own
