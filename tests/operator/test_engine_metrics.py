"""engine_metrics against the exposition text a real EngineMetrics renders, and a real socket."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from tandem.engine.engine_output import EngineTotals, StepStats
from tandem.engine.service.http import HealthServer
from tandem.engine.service.metrics import EngineMetrics
from tandem.operator.engine_metrics import parse_metrics, scrape
from tandem.operator.pod_load import (
    PodSample,
    budget_utilization,
    busy_fraction,
    combine_ranks,
    mean_waiting_prompt_tokens,
    pod_load,
    restarted,
    step_fill,
)
from tandem.operator.sources import DirectScrape

BUDGET = 1000
SLOTS = 64


class FakeEngine:
    """Just what EngineMetrics.observe_step reads: the last step, totals, the scheduler."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.last_step = StepStats()
        self.totals = EngineTotals()
        self.scheduler = SimpleNamespace(
            config=SimpleNamespace(max_num_batched_tokens=budget, max_running=SLOTS),
            kv_usage=0.0,
            num_running=0,
            num_waiting=0,
            waiting_prompt_tokens=0,
            handoff={},
            receiving={},
        )

    def step(self, metrics: EngineMetrics, *, prefill: bool, tokens: int, seconds: float) -> None:
        self.last_step = StepStats(prefill, tokens, num_seqs=1, seconds=seconds)
        metrics.observe_step(self)  # type: ignore[arg-type]


def sample(metrics: EngineMetrics, at: float, *, pod: str = "p0", ready: bool = True):
    return parse_metrics(metrics.render().decode(), pod=pod, ready=ready, scraped_at=at)


def test_parses_the_gauges_and_counters_an_engine_renders():
    metrics, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    engine.scheduler.kv_usage = 0.25
    engine.scheduler.num_running = 3
    engine.scheduler.num_waiting = 2
    engine.scheduler.waiting_prompt_tokens = 640
    engine.scheduler.handoff = {"r1": object()}
    engine.scheduler.receiving = {"r2": object(), "r3": object()}
    engine.step(metrics, prefill=True, tokens=800, seconds=0.5)
    engine.step(metrics, prefill=False, tokens=3, seconds=0.25)

    s = sample(metrics, 12.0)

    assert (s.pod, s.ready, s.scraped_at) == ("p0", True, 12.0)
    assert (s.model, s.role) == ("tiny", "prompt")
    assert s.kv_cache_usage == 0.25
    assert (s.requests_running, s.requests_waiting) == (3, 2)
    assert (s.waiting_prompt_tokens, s.kv_pinned_requests, s.token_budget) == (640, 1, BUDGET)
    assert s.kv_receiving_requests == 2
    assert (s.max_running_requests, s.handoffs_parked) == (SLOTS, 0)
    assert s.steps_total == {"prefill": 1.0, "decode": 1.0}
    assert s.scheduled_tokens_total == {"prefill": 800.0, "decode": 3.0}
    assert s.step_seconds_total == pytest.approx(0.75)
    assert s.started_at is not None


def test_a_data_parallel_rank_s_empty_steps_are_not_counted():
    # An idle rank steps empty while another rank works: no step, tokens or busy time.
    metrics, engine = EngineMetrics("tiny", "normal"), FakeEngine()
    engine.step(metrics, prefill=False, tokens=3, seconds=0.25)
    engine.last_step = StepStats(is_prefill=False, num_scheduled_tokens=0, num_seqs=0, seconds=1)
    metrics.observe_step(engine)  # type: ignore[arg-type]
    s = sample(metrics, 1.0)
    assert s.steps_total == {"decode": 1.0}
    assert s.step_seconds_total == pytest.approx(0.25)


def test_a_data_parallel_pods_busy_time_is_its_busiest_ranks():
    # Ranks time only the steps they compute, so their totals drift apart: rank 0 had
    # stepped 100 s, rank 1 40 s, then rank 1 stepped the whole 15 s interval. The
    # increase of the largest total read 0: a busy prefill pod read idle.
    def pod(at: float, totals: tuple[float, float], steps: tuple[float, float]) -> PodSample:
        ranks = [
            PodSample("p", True, at, 0.5, 1, 0, 0, BUDGET, steps_total={"prefill": n},
                      scheduled_tokens_total={"prefill": 100 * n}, step_seconds_total=t)
            for t, n in zip(totals, steps, strict=True)
        ]  # fmt: skip
        return combine_ranks(ranks)

    before, after = pod(0.0, (100.0, 40.0), (10, 10)), pod(15.0, (100.0, 55.0), (10, 20))
    assert busy_fraction(before, after) == pytest.approx(1.0)
    assert budget_utilization(before, after) == pytest.approx(1.0)
    assert not restarted(before, after)
    # Only a rank's time went back (its other counters did not): a restart all the same.
    assert restarted(after, pod(30.0, (101.0, 2.0), (10, 25)))


def test_an_engine_that_never_stepped_has_no_counters_yet():
    s = sample(EngineMetrics("tiny", "completion"), 0.0)
    assert s.steps_total == {} and s.steps("prefill") == 0.0
    assert s.token_budget == 0 and s.step_seconds_total == 0.0


def test_rates_between_two_scrapes():
    metrics, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    engine.step(metrics, prefill=True, tokens=100, seconds=1.0)
    prev = sample(metrics, 100.0)
    # 10 s later: 4 prefill steps of 500 tokens (half the budget), 2 s of stepping.
    for _ in range(4):
        engine.step(metrics, prefill=True, tokens=500, seconds=0.5)
    engine.step(metrics, prefill=False, tokens=7, seconds=0.0)
    curr = sample(metrics, 110.0)

    assert not restarted(prev, curr)
    assert step_fill(prev, curr) == pytest.approx(0.5)
    assert step_fill(prev, curr, "decode") == pytest.approx(7 / BUDGET)
    assert busy_fraction(prev, curr) == pytest.approx(0.2)
    # The time stepping: a part-full prefill step takes part of a full one's time.
    assert budget_utilization(prev, curr) == pytest.approx(0.2)


def test_a_full_but_rarely_stepping_pod_is_not_read_as_busy():
    # One budget-sized prompt in a minute: every step full, the pod nearly idle.
    metrics, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    prev = sample(metrics, 0.0)
    engine.step(metrics, prefill=True, tokens=BUDGET, seconds=0.6)
    curr = sample(metrics, 60.0)
    assert step_fill(prev, curr) == pytest.approx(1.0)
    assert budget_utilization(prev, curr) == pytest.approx(0.01)


@pytest.mark.parametrize("prefill", [True, False])
def test_a_pod_that_stepped_between_two_scrapes_had_work_whatever_its_gauges_say(prefill):
    # The request came and went between the scrapes: every gauge reads 0 at both.
    metrics, engine = EngineMetrics("tiny", "prompt" if prefill else "completion"), FakeEngine()
    first = sample(metrics, 0.0)
    engine.step(metrics, prefill=prefill, tokens=40, seconds=0.2)
    second, third = sample(metrics, 15.0), sample(metrics, 30.0)
    assert pod_load(second, first).stepped
    assert not pod_load(third, second).stepped  # nothing since
    assert not pod_load(first).stepped  # a first scrape of a pod that never stepped


def test_a_first_scrape_of_a_pod_that_stepped_had_work():
    # A pod woken from zero serves the request that woke it before its first scrape:
    # read idle, the role went back to zero a scrape later, and a trickle of requests
    # cold-started every one.
    metrics, engine = EngineMetrics("tiny", "normal"), FakeEngine()
    engine.step(metrics, prefill=True, tokens=40, seconds=0.2)
    engine.step(metrics, prefill=False, tokens=1, seconds=0.01)
    assert pod_load(sample(metrics, 10.0)).stepped


def test_an_idle_interval_reads_zero_and_a_first_scrape_reads_unknown():
    metrics, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    engine.step(metrics, prefill=True, tokens=500, seconds=0.5)
    prev, curr = sample(metrics, 0.0), sample(metrics, 15.0)
    assert step_fill(prev, curr) is None
    assert budget_utilization(prev, curr) == 0.0
    assert pod_load(curr, prev).budget_utilization == 0.0
    assert pod_load(curr).budget_utilization is None
    # Same or reversed timestamps: no interval, no rate.
    assert budget_utilization(curr, curr) is None


def test_a_restarted_engine_is_detected_by_its_created_timestamps():
    old, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    for _ in range(10):
        engine.step(old, prefill=True, tokens=900, seconds=0.1)
    prev = sample(old, 0.0)
    time.sleep(0.01)  # a later process start: a different _created timestamp
    new, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    for _ in range(20):  # more steps than before: only _created tells the reset
        engine.step(new, prefill=True, tokens=400, seconds=0.1)
    curr = sample(new, 10.0)

    assert restarted(prev, curr)
    # Prometheus' rule: after a reset, the whole counter value is the increase.
    assert step_fill(prev, curr) == pytest.approx(0.4)
    assert busy_fraction(prev, curr) == pytest.approx(0.2)


def test_a_counter_going_down_is_a_reset_without_created_series():
    old, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    for _ in range(10):
        engine.step(old, prefill=True, tokens=900, seconds=0.1)
    new, engine = EngineMetrics("tiny", "prompt"), FakeEngine()
    for _ in range(2):
        engine.step(new, prefill=True, tokens=300, seconds=0.5)

    def without_created(m: EngineMetrics, at: float) -> PodSample:
        text = "\n".join(
            line for line in m.render().decode().splitlines() if "_created" not in line
        )
        return parse_metrics(text + "\n", pod="p0", ready=True, scraped_at=at)

    prev, curr = without_created(old, 0.0), without_created(new, 10.0)
    assert prev.started_at is None
    assert restarted(prev, curr)
    assert step_fill(prev, curr) == pytest.approx(0.3)
    assert busy_fraction(prev, curr) == pytest.approx(0.1)


class Buffer:
    """An engine's metrics whose waiting prompt tokens the test sets at chosen times."""

    def __init__(self) -> None:
        self.now = 0.0
        self.metrics = EngineMetrics("tiny", "normal", clock=lambda: self.now)
        self.engine = FakeEngine()

    def hold(self, tokens: int, at: float) -> None:
        self.now = at
        self.engine.scheduler.waiting_prompt_tokens = tokens
        self.metrics.observe_queues(self.engine)  # type: ignore[arg-type]

    def scrape(self, at: float) -> PodSample:
        self.now = at
        return sample(self.metrics, at)


def test_the_mean_of_waiting_tokens_counts_every_moment_not_the_scrape_instant():
    # A NORMAL engine's buffer: full (12,000 tokens) for 5 s of each 15 s, empty
    # whenever it is scraped. The gauge says 0 at both scrapes; the mean is 4,000.
    buffer = Buffer()
    prev = buffer.scrape(0.0)
    buffer.hold(12_000, at=4.0)
    buffer.hold(0, at=9.0)
    curr = buffer.scrape(15.0)

    assert curr.waiting_prompt_tokens == 0
    assert curr.waiting_token_seconds_total == pytest.approx(60_000)
    assert mean_waiting_prompt_tokens(prev, curr) == pytest.approx(4_000)
    load = pod_load(curr, prev)
    assert load.buffered_tokens == pytest.approx(4_000)
    assert load.waiting_prompt_tokens == 0  # the gauge still says what is there now


def test_waiting_tokens_count_until_the_scrape_itself():
    buffer = Buffer()
    buffer.hold(300, at=0.0)
    first = buffer.scrape(2.0)
    second = buffer.scrape(7.0)  # no change since: the counter still grows
    assert first.waiting_token_seconds_total == pytest.approx(600)
    assert mean_waiting_prompt_tokens(first, second) == pytest.approx(300)


def test_without_the_integral_or_across_a_restart_the_gauge_stands_in():
    old = Buffer()
    old.hold(500, at=0.0)
    prev = old.scrape(10.0)
    time.sleep(0.01)  # a later process start
    new = Buffer()
    new.hold(500, at=10.0)
    curr = new.scrape(20.0)
    assert restarted(prev, curr)
    assert mean_waiting_prompt_tokens(prev, curr) is None
    assert pod_load(curr, prev).buffered_tokens == 500
    assert pod_load(curr).buffered_tokens == 500  # a first scrape: no interval yet

    # An engine from before the counter existed.
    text = "\n".join(
        line for line in old.metrics.render().decode().splitlines() if "token_seconds" not in line
    )
    bare = parse_metrics(text + "\n", pod="p0", ready=True, scraped_at=30.0)
    assert bare.waiting_token_seconds_total is None
    assert mean_waiting_prompt_tokens(prev, bare) is None
    assert pod_load(bare, prev).buffered_tokens == 500


def test_text_that_is_not_an_engines_metrics_is_refused():
    with pytest.raises(ValueError, match="tandem_engine_kv_cache_usage"):
        parse_metrics("# TYPE up gauge\nup 1\n", pod="p0", ready=True, scraped_at=0.0)


def with_value(text: str, series: str, value: str) -> str:
    """`text` with the first sample of `series` (tandem_engine_ left out) set to `value`."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"tandem_engine_{series}{{"))
    lines[i] = f"{lines[i].rsplit(' ', 1)[0]} {value}"
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("series", "value"),
    [
        ("kv_cache_usage", "-1.0"),
        ("kv_cache_usage", "50.0"),
        ("kv_cache_usage", "NaN"),
        ("requests_running", "-1"),
        ("waiting_prompt_tokens", "+Inf"),
        ("scheduled_tokens_total", "-800"),
        ("step_seconds_sum", "NaN"),
        ("waiting_prompt_token_seconds_total", "-1"),
        ("max_running_requests", "-1"),
    ],
)
def test_a_value_no_engine_exports_makes_the_page_unreadable(series, value):
    # Taken at face value, one pod's KV usage of -1 scaled 4 pods at target to 3
    # and 50 scaled them to 8; clamped to 0, a negative count read as idle.
    metrics, engine = EngineMetrics("tiny", "normal"), FakeEngine()
    engine.step(metrics, prefill=True, tokens=800, seconds=0.5)
    text = with_value(metrics.render().decode(), series, value)
    with pytest.raises(ValueError, match=f"tandem_engine_{series} is"):
        parse_metrics(text, pod="p0", ready=True, scraped_at=0.0)


def test_sequence_slots_not_known_yet_or_not_exported_are_none():
    metrics, engine = EngineMetrics("tiny", "normal"), FakeEngine()
    assert sample(metrics, 0.0).max_running_requests is None  # before the first turn: 0
    engine.step(metrics, prefill=True, tokens=800, seconds=0.5)
    page = metrics.render().decode().splitlines()
    older = "\n".join(line for line in page if "max_running_requests" not in line) + "\n"
    assert parse_metrics(older, pod="p0", ready=True, scraped_at=0.0).max_running_requests is None


def test_pod_load_refuses_samples_of_two_pods():
    m = EngineMetrics("tiny", "prompt")
    with pytest.raises(ValueError, match="two pods"):
        pod_load(sample(m, 1.0, pod="a"), sample(m, 0.0, pod="b"))


# ------------------------------------------------------------------ scraping


class Endpoint:
    """The engine's own HTTP server on a free port, with answers a test can swap."""

    def __init__(self) -> None:
        self.render = EngineMetrics("tiny", "normal").render
        self.ready = True
        self.server = HealthServer(
            "127.0.0.1",
            0,
            live=lambda: (True, "ok"),
            ready=lambda: (self.ready, "test"),
            metrics=lambda: self.render(),
        ).start()
        self.url = f"http://127.0.0.1:{self.server.port}"

    def serve(self, render, *, ready: bool = True) -> str:
        self.render, self.ready = render, ready
        return self.url


@pytest.fixture(scope="module")
def endpoint():
    # One server for the module: each shutdown waits out serve_forever's 0.5 s poll.
    ep = Endpoint()
    yield ep
    ep.server.stop()


def scrape_once(url: str) -> PodSample | None:
    async def run() -> PodSample | None:
        async with httpx.AsyncClient() as client:
            return await scrape(client, url, "p0")

    return asyncio.run(run())


def test_scrape_reads_a_live_engine(endpoint):
    metrics, engine = EngineMetrics("tiny", "completion"), FakeEngine()
    engine.scheduler.kv_usage = 0.5
    engine.step(metrics, prefill=False, tokens=4, seconds=0.01)
    url = endpoint.serve(metrics.render)
    before = time.monotonic()
    s = scrape_once(url + "/")
    assert s is not None and s.ready and s.kv_cache_usage == 0.5
    assert s.steps_total == {"decode": 1.0}
    assert before <= s.scraped_at <= time.monotonic()


def test_a_pod_whose_readiness_probe_fails_is_sampled_not_ready(endpoint):
    s = scrape_once(endpoint.serve(EngineMetrics("tiny", "normal").render, ready=False))
    assert s is not None and not s.ready


def test_an_erroring_or_foreign_metrics_page_is_none(endpoint):
    def broken() -> bytes:
        raise RuntimeError("boom")  # HealthServer answers 500

    impossible = EngineMetrics("tiny", "normal")
    impossible.kv_cache_usage.set(-1.0)
    foreign = (lambda: b"# TYPE up gauge\nup 1\n", lambda: b"\xff{not prometheus")
    for render in (broken, *foreign, impossible.render):
        assert scrape_once(endpoint.serve(render)) is None


def test_direct_scrape_is_a_sample_source(endpoint):
    url = endpoint.serve(EngineMetrics("tiny", "prompt").render)

    async def run() -> PodSample | None:
        async with httpx.AsyncClient() as client:
            return await DirectScrape(client).sample("p7", url)

    s = asyncio.run(run())
    assert s is not None and s.pod == "p7"


def test_many_pods_are_scraped_a_few_at_a_time_each_within_its_own_timeout(endpoint):
    metrics, lock = EngineMetrics("tiny", "normal"), threading.Lock()
    in_flight, most = [0], [0]

    def slow() -> bytes:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.15)
        with lock:
            in_flight[0] -= 1
        return metrics.render()

    url = endpoint.serve(slow)

    async def run() -> list[PodSample | None]:
        async with httpx.AsyncClient() as client:
            source = DirectScrape(client, timeout=0.5, slots=asyncio.Semaphore(2))
            return await asyncio.gather(*(source.sample(f"p{i}", url) for i in range(8)))

    # Four rounds of 0.15 s: past each pod's 0.5 s, which starts once it has a slot.
    assert all(s is not None for s in asyncio.run(run()))
    assert most[0] <= 2
