"""The run: send the workload's requests at their arrival times, at most `concurrency` at once.

Open loop with a cap: each request leaves at its planned offset unless
`concurrency` requests are already in flight, in which case it (and those
behind it) waits for a slot; records keep both times. With rate inf the
cap alone paces the run (a closed loop of `concurrency` clients). The run
sends until `num_requests` were sent, `duration_s` passed or the workload
ended (a trace), then waits for what is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from tandem.loadgen.client import Target, send
from tandem.loadgen.progress import Progress, progress_line
from tandem.loadgen.record import RequestRecord
from tandem.loadgen.replicas import ReplicaPoller, ReplicaSample
from tandem.trace import TraceRequest

# (index, prompt tokens) -> the prompt to send.
PromptMaker = Callable[[int, int], "str | list[int]"]


@dataclass(frozen=True)
class RunLimits:
    # Requests to send at most; None: no count limit.
    num_requests: int | None = None
    # Seconds after which no new request is sent; None: no time limit.
    duration_s: float | None = None
    # Requests in flight at most; None: no cap.
    concurrency: int | None = None


@dataclass
class RunResult:
    # One per request sent, in workload order.
    records: list[RequestRecord]
    # First send to the last successful answer (to the last end where none
    # succeeded), seconds: the denominator of every rate.
    wall_s: float
    # Unix time at the start, for the report.
    started_at: float
    # Replicas per role over time (empty without a registry to poll).
    replicas: list[ReplicaSample] = field(default_factory=list)
    # Why the registry could not be read, when it could not.
    replicas_error: str | None = None
    # Requests in flight when Ctrl-C ended the run (dropped: neither ok nor
    # failed); None when the run was not interrupted.
    interrupted: int | None = None
    # Arrivals within --duration were never sent: every --concurrency slot stayed taken.
    left_unsent: bool = False
    # Every arrival at 0 (--rate inf): the sends wait for --concurrency slots by design,
    # and no offered load can be missed.
    closed_loop: bool = False


@dataclass
class _Counters:
    done: int = 0
    ok: int = 0
    in_flight: int = 0
    left_unsent: bool = False  # an arrival within --duration found no slot before its end
    timed: bool = False  # an arrival after 0 was seen: an offered load, which may be missed


async def run(
    target: Target,
    workload: Iterator[TraceRequest],
    make_prompt: PromptMaker,
    limits: RunLimits,
    progress: Progress,
    poller: ReplicaPoller | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """Send the workload; `transport` replaces the network (tests)."""
    pool = httpx.Limits(max_connections=limits.concurrency, max_keepalive_connections=None)
    # The total deadline is enforced per request (Target.timeout_s); waiting for a
    # pooled connection is the concurrency cap working, not a timeout.
    timeout = httpx.Timeout(target.timeout_s, pool=None)
    async with httpx.AsyncClient(
        headers=target.headers, timeout=timeout, limits=pool, transport=transport
    ) as client:
        started_at = time.time()
        t0 = time.perf_counter()
        stop = asyncio.Event()
        counters = _Counters()
        background = [asyncio.create_task(_tick(progress, counters, limits, t0, stop))]
        if poller is not None:
            background.append(asyncio.create_task(poller.run(t0, stop)))
        tasks: list[asyncio.Task[RequestRecord]] = []
        sender = asyncio.create_task(
            _send_all(client, target, workload, make_prompt, limits, t0, counters, tasks)
        )
        interrupt = _Interrupt(sender, tasks)
        try:
            with interrupt.on_ctrl_c():
                try:
                    await sender
                    await asyncio.gather(*tasks)
                except asyncio.CancelledError:
                    if not interrupt.fired:
                        raise
                    await asyncio.gather(*tasks, return_exceptions=True)
            records = [t.result() for t in tasks if not t.cancelled()]
        except BaseException:
            # Sending stopped on an error (a bad workload value, a second Ctrl-C): end what it
            # started, so no task outlives the client or dies with its error unread.
            for task in [*tasks, *background]:
                task.cancel()
            await asyncio.gather(*tasks, *background, return_exceptions=True)
            progress.close()
            if poller is not None:
                await poller.close()
            raise
        # Not to a failure's end: one request timing out after --timeout (600 s) cut
        # every rate by as much as it outlasted the answers.
        ends = [r.end_s for r in records if r.end_s is not None]
        ends = [r.end_s for r in records if r.ok and r.end_s is not None] or ends
        wall_s = max(ends) - min(r.start_s for r in records) if ends else 0.0
        stop.set()
        await asyncio.gather(*background)
        progress.update(_line(counters, limits, time.perf_counter() - t0), force=True)
        progress.close()
    result = RunResult(
        records,
        wall_s,
        started_at,
        left_unsent=counters.left_unsent,
        closed_loop=not counters.timed,
    )
    if interrupt.fired:
        result.interrupted = len(tasks) - len(records)
    if poller is not None:
        result.replicas = poller.samples
        result.replicas_error = poller.error
        await poller.close()
    return result


# What ends a run early but keeps it: Ctrl-C, and SIGTERM (`timeout`, a cancelled CI
# job, a Kubernetes Job's end), which otherwise killed it with nothing reported.
_STOPS = (signal.SIGINT, signal.SIGTERM)


class _Interrupt:
    """The first Ctrl-C (or SIGTERM) ends the run early but keeps its result: no new
    request is sent, those in flight are cancelled (the server sees the client leave),
    and the report covers what was answered. A second aborts (Ctrl-C's
    KeyboardInterrupt, SIGTERM's default end)."""

    def __init__(self, sender: asyncio.Task[None], tasks: list[asyncio.Task[RequestRecord]]):
        self.sender, self.tasks = sender, tasks
        self.fired = False

    @contextlib.contextmanager
    def on_ctrl_c(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        try:
            for signum in _STOPS:
                loop.add_signal_handler(signum, self.fire)
        except (NotImplementedError, RuntimeError, ValueError):
            # Not the main thread (or no Unix signals): Ctrl-C stays KeyboardInterrupt.
            yield
            return
        try:
            yield
        finally:
            self._restore(loop)

    @staticmethod
    def _restore(loop: asyncio.AbstractEventLoop) -> None:
        """The defaults again: Ctrl-C is KeyboardInterrupt, SIGTERM ends the process."""
        for signum in _STOPS:
            loop.remove_signal_handler(signum)

    def fire(self) -> None:
        if self.fired:
            raise KeyboardInterrupt
        self.fired = True
        self.sender.cancel()
        for task in self.tasks:
            task.cancel()
        # The next one is the default again: it aborts at once.
        self._restore(asyncio.get_running_loop())


async def _send_all(
    client: httpx.AsyncClient,
    target: Target,
    workload: Iterator[TraceRequest],
    make_prompt: PromptMaker,
    limits: RunLimits,
    t0: float,
    counters: _Counters,
    tasks: list[asyncio.Task[RequestRecord]],
) -> None:
    """Start a task per request, appended to `tasks` (the caller's, to end them on an error)."""
    slots = asyncio.Semaphore(limits.concurrency) if limits.concurrency else None

    async def one(record: RequestRecord, prompt: str | list[int]) -> RequestRecord:
        try:
            return await send(client, target, record, prompt, t0)
        finally:
            counters.done += 1
            counters.ok += record.ok
            counters.in_flight -= 1
            if slots is not None:
                slots.release()

    for index, request in enumerate(workload):
        if limits.num_requests is not None and index >= limits.num_requests:
            break
        if limits.duration_s is not None and request.arrival_s >= limits.duration_s:
            break
        counters.timed = counters.timed or request.arrival_s > 0
        delay = t0 + request.arrival_s - time.perf_counter()
        # Always yield to the loop: with everything due at once the sends must start.
        await asyncio.sleep(max(0.0, delay))
        if slots is not None:
            await slots.acquire()
        if limits.duration_s is not None and time.perf_counter() - t0 >= limits.duration_s:
            if slots is not None:
                slots.release()
            # It arrived within the duration and waited for a slot past it: the offered
            # load was not met, which the report must say (how many more would have
            # come is not known: at --rate inf, without end).
            counters.left_unsent = True
            break
        prompt = make_prompt(index, request.input_tokens)
        record = RequestRecord(
            index=index,
            scheduled_s=request.arrival_s,
            start_s=time.perf_counter() - t0,
            input_tokens=request.input_tokens,
            max_tokens=request.output_tokens,
        )
        counters.in_flight += 1
        tasks.append(asyncio.create_task(one(record, prompt)))


async def _tick(
    progress: Progress, counters: _Counters, limits: RunLimits, t0: float, stop: asyncio.Event
) -> None:
    """Redraw the progress line a few times a second until the run ends."""
    while not stop.is_set():
        progress.update(_line(counters, limits, time.perf_counter() - t0))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)


def _line(counters: _Counters, limits: RunLimits, elapsed_s: float) -> str:
    return progress_line(
        counters.done,
        limits.num_requests,
        counters.ok,
        counters.in_flight,
        elapsed_s,
        limits.duration_s,
    )
