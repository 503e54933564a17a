"""The run: arrival times kept, the concurrency cap held, the count and duration limits obeyed."""

import asyncio
import io

import pytest

from tandem.loadgen.client import Target
from tandem.loadgen.progress import Progress
from tandem.loadgen.runner import RunLimits, run
from tandem.trace import TraceRequest

from .fake_server import FakeServer

TARGET = Target(base_url="http://fake/v1", model="m", timeout_s=10.0)
QUIET = Progress(io.StringIO(), enabled=False)


def bench(server, workload, limits, prompts=None):
    def make_prompt(index, tokens):
        if prompts is not None:
            prompts.append((index, tokens))
        return [index] * tokens

    return asyncio.run(
        run(TARGET, iter(workload), make_prompt, limits, QUIET, transport=server.transport())
    )


def closed_loop(n, tokens=3):
    return [TraceRequest(0.0, 2, tokens) for _ in range(n)]


def test_the_concurrency_cap_is_reached_and_never_exceeded():
    server = FakeServer(first_delay=0.05)
    result = bench(server, closed_loop(12), RunLimits(num_requests=12, concurrency=3))
    assert server.peak == 3
    assert [r.index for r in result.records] == list(range(12))
    assert all(r.ok for r in result.records)
    # Four waves of three: later requests left after their (zero) planned time.
    assert max(r.start_s - r.scheduled_s for r in result.records) >= 0.1
    assert result.wall_s >= 4 * 0.05


def test_planned_arrivals_are_kept_when_there_is_room():
    arrivals = [0.0, 0.2, 0.4, 0.6]
    workload = [TraceRequest(t, 2, 2) for t in arrivals]
    result = bench(FakeServer(), workload, RunLimits(concurrency=8))
    # Timer slack on a busy 2-core machine: under the 0.2 s between arrivals.
    for record, planned in zip(result.records, arrivals, strict=True):
        assert planned <= record.start_s < planned + 0.19
    # The wall time runs from the first send, not from the start of the run.
    assert result.wall_s < 0.6 + 0.19
    assert not result.left_unsent


class _OneHangs(FakeServer):
    """Answers at once, but for a request of 9 tokens, which it never answers."""

    async def _stream(self, body):
        if body["max_tokens"] == 9:
            await asyncio.sleep(30)
        async for chunk in super()._stream(body):
            yield chunk


def test_the_wall_time_ends_at_the_last_answer_not_at_a_timeout():
    # A request that timed out after the others were answered stretched the wall
    # time, and cut every rate (by 10x and more at the default 600 s --timeout).
    workload = [TraceRequest(0.0, 2, 9), *(TraceRequest(0.0, 2, 2) for _ in range(3))]
    target = Target(base_url="http://fake/v1", model="m", timeout_s=1.0)
    result = asyncio.run(
        run(target, iter(workload), lambda i, n: [1] * n, RunLimits(), QUIET,
            transport=_OneHangs().transport())
    )  # fmt: skip
    assert [r.ok for r in result.records] == [False, True, True, True]
    assert result.records[0].error_kind == "timeout"
    assert result.wall_s < 0.5, result.wall_s


def test_the_request_count_limit_and_the_prompts():
    prompts = []
    server = FakeServer()
    workload = [TraceRequest(0.0, 2 + i, 1) for i in range(10)]
    result = bench(server, workload, RunLimits(num_requests=4), prompts)
    assert len(result.records) == 4
    assert prompts == [(0, 2), (1, 3), (2, 4), (3, 5)]
    assert [b["prompt"] for b in server.bodies] == [[0, 0], [1, 1, 1], [2] * 4, [3] * 5]


def test_the_duration_limit_stops_sending_and_waits_for_what_is_in_flight():
    server = FakeServer(first_delay=0.1)

    def endless():
        while True:
            yield TraceRequest(0.0, 2, 2)

    result = asyncio.run(
        run(
            TARGET,
            endless(),
            lambda i, n: [1] * n,
            RunLimits(duration_s=0.35, concurrency=2),
            QUIET,
            transport=server.transport(),
        )
    )
    # Two at a time, 0.1 s each, for 0.35 s: at most 4 waves of 2; at least 2 waves
    # even on a busy machine (sending did not stop after the first).
    assert 4 <= len(result.records) <= 8
    assert all(r.start_s < 0.35 for r in result.records)
    assert all(r.ok for r in result.records)
    assert result.left_unsent  # arrivals waited for a slot past the end
    assert result.closed_loop  # ... all at 0: no offered load, and none missed


def test_the_progress_line_ends_with_the_final_counts():
    stream = io.StringIO()
    progress = Progress(stream, enabled=True)
    asyncio.run(
        run(
            TARGET,
            iter(closed_loop(5)),
            lambda i, n: [1] * n,
            RunLimits(num_requests=5),
            progress,
            transport=FakeServer().transport(),
        )
    )
    last = stream.getvalue().rstrip("\n").split("\r")[-1]
    assert "5/5" in last and "ok 5  err 0  in flight 0" in last


def test_a_workload_that_fails_midway_leaves_no_task_behind():
    # A value the workload refuses only once sending began: what was started must be
    # ended, not left to fail on the closed client ("Task exception was never retrieved").
    def failing():
        yield TraceRequest(0.0, 2, 2)
        raise ValueError("bad request 2")

    async def go():
        with pytest.raises(ValueError, match="bad request 2"):
            await run(
                TARGET,
                failing(),
                lambda i, n: [1] * n,
                RunLimits(),
                QUIET,
                transport=FakeServer(first_delay=5).transport(),
            )
        return asyncio.all_tasks() - {asyncio.current_task()}

    assert asyncio.run(go()) == set()
