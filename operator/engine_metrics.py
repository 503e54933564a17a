"""Engine metrics for the autoscaler: scrape /metrics into samples, two samples into a load.

A `PodSample` is one scrape of one engine (docs/metrics.md): its gauges as they
were, its counters as running totals. Rates need two samples of the same pod;
`pod_load(curr, prev)` turns them into the `PodLoad` the autoscaler reads.

Direct scraping is the default (no Prometheus needed, and `tandem up` has none).
A Prometheus server can stand in through `SampleSource`: the same samples, read
with instant queries instead of HTTP GETs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# Long enough for an engine busy in a step (its HTTP server has its own thread),
# short enough that one dead pod does not stall an evaluation of all the others.
DEFAULT_TIMEOUT_S = 2.0

_PREFIX = "tandem_engine_"
# Gauges a sample cannot do without: a /metrics page lacking one is not an engine's.
_REQUIRED_GAUGES = (
    "kv_cache_usage",
    "requests_running",
    "requests_waiting",
    "waiting_prompt_tokens",
    "token_budget",
)
# Counters (and the step histogram's sum and _created) a sample keeps, by `kind` label.
_COUNTERS = frozenset(
    {
        "steps_total",
        "scheduled_tokens_total",
        "step_seconds_sum",
        "step_seconds_created",
        "waiting_prompt_token_seconds_total",
    }
)


@dataclass(frozen=True, slots=True)
class PodSample:
    """One scrape of one engine's /metrics (and /readyz)."""

    pod: str
    ready: bool
    # Seconds on the scraper's monotonic clock; only differences between two
    # samples of the same pod mean anything.
    scraped_at: float
    kv_cache_usage: float
    requests_running: int
    requests_waiting: int
    waiting_prompt_tokens: int
    token_budget: int
    kv_pinned_requests: int = 0
    # Counters by step kind ("prefill", "decode"): running totals since the
    # engine started, absent until the first step of that kind.
    steps_total: Mapping[str, float] = field(default_factory=dict)
    scheduled_tokens_total: Mapping[str, float] = field(default_factory=dict)
    # Sum of tandem_engine_step_seconds: seconds spent stepping since the start.
    step_seconds_total: float = 0.0
    # tandem_engine_waiting_prompt_token_seconds_total: waiting_prompt_tokens
    # integrated over time; None from an engine that does not export it.
    waiting_token_seconds_total: float | None = None
    # The step_seconds histogram's _created timestamp: set when the engine's
    # metrics were made, so a new value means the process restarted.
    started_at: float | None = None
    model: str = ""
    role: str = ""

    def steps(self, kind: str) -> float:
        return self.steps_total.get(kind, 0.0)

    def scheduled_tokens(self, kind: str) -> float:
        return self.scheduled_tokens_total.get(kind, 0.0)


@dataclass(frozen=True, slots=True)
class PodLoad:
    """What the autoscaler reads about one pod: gauges now, rates since the last scrape.

    Every value is in range (parse_metrics refuses a page with one that is not,
    and the rates of in-range counters are), so the autoscaler takes them as they are.
    """

    pod: str
    ready: bool
    kv_cache_usage: float
    requests_running: int
    requests_waiting: int
    waiting_prompt_tokens: int
    kv_pinned_requests: int = 0
    # budget_utilization() over the last interval; None on a pod's first scrape.
    budget_utilization: float | None = None
    # mean_waiting_prompt_tokens() over the last interval; None on a pod's first
    # scrape, across a restart, or from an engine without the counter.
    mean_waiting_prompt_tokens: float | None = None

    @property
    def buffered_tokens(self) -> float:
        """The engine's share of the queued-tokens signal: its mean, else the gauge now."""
        mean = self.mean_waiting_prompt_tokens
        return self.waiting_prompt_tokens if mean is None else mean


def parse_metrics(text: str, *, pod: str, ready: bool, scraped_at: float) -> PodSample:
    """A PodSample from Prometheus text exposition.

    ValueError if it is not an engine's, or holds a value no engine exports
    (`_in_range`): the pod then counts as unreadable, as if its scrape failed.
    """
    gauges: dict[str, float] = {}
    counters: dict[tuple[str, str], float] = {}
    labels: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith(_PREFIX):
                continue
            name = s.name[len(_PREFIX) :]
            if name in _COUNTERS:
                counters[name, s.labels.get("kind", "")] = _in_range(pod, name, s.value)
            elif family.type == "gauge":
                gauges[name] = s.value
                labels = labels or dict(s.labels)
    missing = [g for g in _REQUIRED_GAUGES if g not in gauges]
    if missing:
        raise ValueError(f"{pod}: /metrics lacks {', '.join(_PREFIX + g for g in missing)}")

    def count(name: str) -> int:
        return int(_in_range(pod, name, gauges.get(name, 0.0)))

    def by_kind(name: str) -> dict[str, float]:
        return {kind: v for (n, kind), v in counters.items() if n == name}

    return PodSample(
        pod=pod,
        ready=ready,
        scraped_at=scraped_at,
        kv_cache_usage=_in_range(pod, "kv_cache_usage", gauges["kv_cache_usage"], high=1.0),
        requests_running=count("requests_running"),
        requests_waiting=count("requests_waiting"),
        waiting_prompt_tokens=count("waiting_prompt_tokens"),
        token_budget=count("token_budget"),
        kv_pinned_requests=count("kv_pinned_requests"),
        steps_total=by_kind("steps_total"),
        scheduled_tokens_total=by_kind("scheduled_tokens_total"),
        step_seconds_total=counters.get(("step_seconds_sum", ""), 0.0),
        waiting_token_seconds_total=counters.get(("waiting_prompt_token_seconds_total", "")),
        started_at=counters.get(("step_seconds_created", "")),
        model=labels.get("model", ""),
        role=labels.get("role", ""),
    )


def _in_range(pod: str, name: str, value: float, high: float = math.inf) -> float:
    # Rule 2 of docs/scaling.md, never scale on a guess: an engine exports no
    # NaN, no infinity, no negative count or total and no KV usage above 1. Such
    # a value comes from a broken engine or proxy, and taking it (or clamping it
    # to 0) would scale on it: the pod must count as unreadable instead.
    if not (math.isfinite(value) and 0.0 <= value <= high):
        raise ValueError(f"{pod}: {_PREFIX}{name} is {value!r}, outside [0, {high:g}]")
    return value


# ------------------------------------------------------------------ rates


def restarted(prev: PodSample, curr: PodSample) -> bool:
    """Whether the engine restarted between the two samples (its counters reset)."""
    both = prev.started_at is not None and curr.started_at is not None
    if both and prev.started_at != curr.started_at:
        return True
    pairs = [(prev.step_seconds_total, curr.step_seconds_total)]
    if (
        prev.waiting_token_seconds_total is not None
        and curr.waiting_token_seconds_total is not None
    ):
        pairs.append((prev.waiting_token_seconds_total, curr.waiting_token_seconds_total))
    for kind in {*prev.steps_total, *prev.scheduled_tokens_total}:
        pairs.append((prev.steps(kind), curr.steps(kind)))
        pairs.append((prev.scheduled_tokens(kind), curr.scheduled_tokens(kind)))
    # Without _created series, a counter going down is the only sign (Prometheus' rule).
    return any(after < before for before, after in pairs)


def _increase(before: float, after: float, *, reset: bool) -> float:
    # After a restart the counter counted from zero: all of its value is new
    # (what Prometheus' increase() assumes too).
    return after if reset else after - before


def step_fill(prev: PodSample, curr: PodSample, kind: str = "prefill") -> float | None:
    """Mean share of the token budget that the `kind` steps of the interval filled.

    rate(scheduled_tokens_total{kind}) / rate(steps_total{kind}) / token_budget
    (docs/metrics.md). None when the interval had no such step or no budget.
    """
    reset = restarted(prev, curr)
    steps = _increase(prev.steps(kind), curr.steps(kind), reset=reset)
    tokens = _increase(prev.scheduled_tokens(kind), curr.scheduled_tokens(kind), reset=reset)
    if steps <= 0 or curr.token_budget <= 0:
        return None
    return max(0.0, tokens / steps / curr.token_budget)


def busy_fraction(prev: PodSample, curr: PodSample) -> float | None:
    """Share of the interval the engine spent stepping; None for a bad interval."""
    interval = curr.scraped_at - prev.scraped_at
    if not interval > 0:
        return None
    reset = restarted(prev, curr)
    busy = _increase(prev.step_seconds_total, curr.step_seconds_total, reset=reset)
    return min(1.0, max(0.0, busy / interval))


def budget_utilization(prev: PodSample, curr: PodSample) -> float | None:
    """Share of the pod's prefill token capacity used in the interval, in [0, 1].

    step_fill("prefill") x busy_fraction. Fill alone does not shrink when the
    load is spread over more pods: a pod that prefills one budget-sized prompt a
    minute reads 100 % full, and so would every pod added for it, up to
    max_replicas. Weighting by the time spent stepping makes an idle pod read
    idle. A pod that ran no prefill step in the interval reads 0.
    """
    busy = busy_fraction(prev, curr)
    if busy is None or curr.token_budget <= 0:
        return None
    fill = step_fill(prev, curr, "prefill")
    return 0.0 if fill is None else min(1.0, fill * busy)


def mean_waiting_prompt_tokens(prev: PodSample, curr: PodSample) -> float | None:
    """Mean prompt tokens waiting in the engine over the interval.

    rate(waiting_prompt_token_seconds_total). The gauge swings between an empty
    and a full buffer around each prompt step, so one reading can say 0.4 or 3.7
    replicas at one load; the rate is the interval's mean. None without the
    counter, for a bad interval, or across a restart (the counter then began
    inside the interval, at a time the scraper does not know).
    """
    before, after = prev.waiting_token_seconds_total, curr.waiting_token_seconds_total
    interval = curr.scraped_at - prev.scraped_at
    if before is None or after is None or not interval > 0 or restarted(prev, curr):
        return None
    return max(0.0, (after - before) / interval)


def pod_load(curr: PodSample, prev: PodSample | None = None) -> PodLoad:
    """The autoscaler's view of a pod: `prev` is the previous sample of the same pod."""
    if prev is not None and prev.pod != curr.pod:
        raise ValueError(f"samples of two pods: {prev.pod!r} and {curr.pod!r}")
    return PodLoad(
        pod=curr.pod,
        ready=curr.ready,
        kv_cache_usage=curr.kv_cache_usage,
        requests_running=curr.requests_running,
        requests_waiting=curr.requests_waiting,
        waiting_prompt_tokens=curr.waiting_prompt_tokens,
        kv_pinned_requests=curr.kv_pinned_requests,
        budget_utilization=None if prev is None else budget_utilization(prev, curr),
        mean_waiting_prompt_tokens=None if prev is None else mean_waiting_prompt_tokens(prev, curr),
    )


# ------------------------------------------------------------------ scraping


async def scrape(
    client: httpx.AsyncClient, url: str, pod: str, *, timeout: float = DEFAULT_TIMEOUT_S
) -> PodSample | None:
    """Scrape one engine at `url` (its base URL, e.g. http://10.0.0.7:8100).

    GETs /metrics and /readyz together, each within `timeout` seconds in all.
    None when the pod cannot be read (down, slower than that, not an engine, a
    value out of range): the autoscaler counts it as a pod without metrics,
    which is not an error. A pod whose /readyz fails is sampled as not ready.
    """
    base = url.rstrip("/")
    try:
        metrics, readyz = await asyncio.gather(
            _get(client, f"{base}/metrics", timeout),
            _get(client, f"{base}/readyz", timeout),
            return_exceptions=True,
        )
        if isinstance(metrics, BaseException):
            raise metrics
        metrics.raise_for_status()
        ready = isinstance(readyz, httpx.Response) and readyz.status_code == 200
        return parse_metrics(metrics.text, pod=pod, ready=ready, scraped_at=time.monotonic())
    except (httpx.HTTPError, TimeoutError, ValueError) as exc:
        # ValueError: a page that is not Prometheus text, not an engine's, or
        # holding a value out of range.
        # DEBUG: a pod failing is routine; scaling.evaluate warns once per role.
        log.debug("scrape of %s at %s failed: %r", pod, base, exc)
        return None


async def _get(client: httpx.AsyncClient, url: str, timeout: float) -> httpx.Response:
    # httpx's timeout bounds each connect and each read, not the request: an
    # engine (or proxy) sending a byte a second would hold a scrape for minutes.
    async with asyncio.timeout(timeout):
        return await client.get(url, timeout=timeout)


class SampleSource(Protocol):
    """Where samples come from: scraping each engine, or a Prometheus server.

    A Prometheus implementation answers `sample` with instant queries of the
    same series, filtered by the pod label that kubernetes_sd relabelling
    attaches (`tandem_engine_kv_cache_usage{pod="..."}`, and so on, the
    `_created` and `_sum` series included), readiness from
    `kube_pod_status_ready` (kube-state-metrics) and `scraped_at` from the
    sample timestamps. Counters stay running totals, so pod_load() computes the
    rates exactly as for direct scrapes; only the freshness differs (one
    Prometheus scrape interval behind). A value out of range makes the pod
    unreadable (None), as parse_metrics does.
    """

    async def sample(self, pod: str, url: str) -> PodSample | None: ...


@dataclass(frozen=True, slots=True)
class DirectScrape:
    """The default SampleSource: GET each engine's /metrics."""

    client: httpx.AsyncClient
    timeout: float = DEFAULT_TIMEOUT_S

    async def sample(self, pod: str, url: str) -> PodSample | None:
        return await scrape(self.client, url, pod, timeout=self.timeout)
