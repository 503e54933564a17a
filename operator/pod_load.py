"""Engine load, pure: samples of an engine's metrics, and two samples into the autoscaler's load.

A `PodSample` is one scrape of one engine (docs/metrics.md): its gauges as they
were, its counters as running totals. Rates need two samples of the same pod;
`pod_load(curr, prev)` turns them into the `PodLoad` the autoscaler reads.
No I/O: engine_metrics.py reads samples from an engine's /metrics, the
simulator makes them from its pods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

# The logger of the scrapes that make samples (engine_metrics.py): each pod that
# cannot be read, at DEBUG. Named here so that the autoscaler's glue can point at
# it (scaling.py) without importing the HTTP client.
SCRAPE_LOG = "tandem.operator.engine_metrics"


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
    # COMPLETION: handoffs whose KV is being fetched, their blocks held (in kv_cache_usage).
    kv_receiving_requests: int = 0
    # COMPLETION: handoffs taken that wait for KV room (no scheduler queue holds them).
    handoffs_parked: int = 0
    # Sequence slots (requests running at once, at least 1); None: an engine from
    # before the gauge.
    max_running_requests: int | None = None
    # Counters by step kind ("prefill", "decode"): running totals since the
    # engine started, absent until the first step of that kind.
    steps_total: Mapping[str, float] = field(default_factory=dict)
    scheduled_tokens_total: Mapping[str, float] = field(default_factory=dict)
    # Sum of tandem_engine_step_seconds: seconds spent stepping since the start.
    step_seconds_total: float = 0.0
    # A data-parallel pod's: each rank's own sum, rank 0 first (empty for one rank).
    # Ranks time only the steps they compute, so their totals drift apart: the pod's
    # busy time is the largest rank's increase, not the increase of the largest total.
    rank_step_seconds: tuple[float, ...] = ()
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

    Every value is in range (engine_metrics.parse_metrics refuses a page with one that is not,
    and the rates of in-range counters are), so the autoscaler takes them as they are.
    """

    pod: str
    ready: bool
    kv_cache_usage: float
    requests_running: int
    requests_waiting: int
    waiting_prompt_tokens: int
    kv_pinned_requests: int = 0
    # COMPLETION: handoffs whose KV is being fetched, their blocks held (in kv_cache_usage).
    kv_receiving_requests: int = 0
    handoffs_parked: int = 0  # COMPLETION: taken, waiting for KV room
    max_running_requests: int | None = None  # sequence slots; None: not exported
    # budget_utilization() over the last interval; None on a pod's first scrape.
    budget_utilization: float | None = None
    # mean_waiting_prompt_tokens() over the last interval; None on a pod's first
    # scrape, across a restart, or from an engine without the counter.
    mean_waiting_prompt_tokens: float | None = None
    # Whether the engine computed a step since the previous scrape: work that came and
    # went between two scrapes, which no gauge shows (False on a pod's first scrape).
    stepped: bool = False

    @property
    def buffered_tokens(self) -> float:
        """The engine's share of the queued-tokens signal: its mean, else the gauge now."""
        mean = self.mean_waiting_prompt_tokens
        return self.waiting_prompt_tokens if mean is None else mean


# ------------------------------------------------------------------ rates


def combine_ranks(ranks: Sequence[PodSample]) -> PodSample:
    """One data-parallel pod's sample from its ranks' (rank 0 first), as the pod's
    PromQL sums them (docs/metrics.md): requests, tokens and steps summed (a rank's
    empty steps are no steps), KV usage the mean of equal pools, the token budget a
    rank's (a step's fill is per rank), each rank's time stepping kept (busy_fraction
    takes the busiest rank's increase), and a restart of any rank a restart of the pod."""
    if len(ranks) == 1:
        return ranks[0]

    def total(name: str) -> int:
        return sum(getattr(r, name) for r in ranks)

    def by_kind(name: str) -> dict[str, float]:
        kinds = {kind for r in ranks for kind in getattr(r, name)}
        return {k: sum(getattr(r, name).get(k, 0.0) for r in ranks) for k in kinds}

    waiting = [r.waiting_token_seconds_total for r in ranks]
    slots = [r.max_running_requests for r in ranks]
    started = [r.started_at for r in ranks]
    return replace(
        ranks[0],
        ready=all(r.ready for r in ranks),
        scraped_at=max(r.scraped_at for r in ranks),
        kv_cache_usage=sum(r.kv_cache_usage for r in ranks) / len(ranks),
        requests_running=total("requests_running"),
        requests_waiting=total("requests_waiting"),
        waiting_prompt_tokens=total("waiting_prompt_tokens"),
        token_budget=max(r.token_budget for r in ranks),
        kv_pinned_requests=total("kv_pinned_requests"),
        kv_receiving_requests=total("kv_receiving_requests"),
        handoffs_parked=total("handoffs_parked"),
        max_running_requests=None if None in slots else sum(slots),  # type: ignore[arg-type]
        steps_total=by_kind("steps_total"),
        scheduled_tokens_total=by_kind("scheduled_tokens_total"),
        step_seconds_total=max(r.step_seconds_total for r in ranks),
        rank_step_seconds=tuple(r.step_seconds_total for r in ranks),
        waiting_token_seconds_total=None if None in waiting else sum(waiting),  # type: ignore[arg-type]
        started_at=None if None in started else max(started),  # type: ignore[type-var]
    )


def restarted(prev: PodSample, curr: PodSample) -> bool:
    """Whether the engine restarted between the two samples (its counters reset)."""
    both = prev.started_at is not None and curr.started_at is not None
    if both and prev.started_at != curr.started_at:
        return True
    pairs = [(prev.step_seconds_total, curr.step_seconds_total)]
    if len(prev.rank_step_seconds) == len(curr.rank_step_seconds):
        pairs += zip(prev.rank_step_seconds, curr.rank_step_seconds, strict=True)
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
    ranks = prev.rank_step_seconds, curr.rank_step_seconds
    if ranks[0] and len(ranks[0]) == len(ranks[1]):  # the busiest rank's share
        busy = max(_increase(b, a, reset=reset) for b, a in zip(*ranks, strict=True))
    else:
        busy = _increase(prev.step_seconds_total, curr.step_seconds_total, reset=reset)
    return min(1.0, max(0.0, busy / interval))


def budget_utilization(prev: PodSample, curr: PodSample) -> float | None:
    """Share of the pod's prefill token capacity used in the interval, in [0, 1]: the
    share of it the pod spent prefilling.

    A prefill step is compute-bound, its time grows with its tokens, so the time spent
    stepping is the capacity used, full steps or not. (step_fill x busy counted a part-
    full step's shortfall twice: a pod 60 % busy on 1,000-token prompts at a budget of
    8,192 read 7 %, and under a steady load the role fell from 8 pods to 1, then climbed
    back on the queue that left, a cycle of minutes.) Fill alone does not shrink as pods
    are added: a pod prefilling one budget-sized prompt a minute reads 100 % full, and so
    would every pod added for it; its duty cycle reads 1 %. Where a small step costs
    nearly a full one's time (a GPU at small batches) this reads high: more pods than
    batching would need, never fewer. A pod that ran no prefill step reads 0.
    """
    busy = busy_fraction(prev, curr)
    if busy is None or curr.token_budget <= 0:
        return None
    return 0.0 if step_fill(prev, curr, "prefill") is None else busy


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


def stepped(prev: PodSample, curr: PodSample) -> bool:
    """Whether the engine ran a step between the two samples (after a restart: at all)."""
    reset = restarted(prev, curr)
    kinds = {*prev.steps_total, *curr.steps_total}
    return any(_increase(prev.steps(k), curr.steps(k), reset=reset) > 0 for k in kinds)


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
        kv_receiving_requests=curr.kv_receiving_requests,
        handoffs_parked=curr.handoffs_parked,
        max_running_requests=curr.max_running_requests,
        budget_utilization=None if prev is None else budget_utilization(prev, curr),
        mean_waiting_prompt_tokens=None if prev is None else mean_waiting_prompt_tokens(prev, curr),
        # A first scrape counts any step so far: a pod woken from zero served the request
        # that woke it before its first scrape, and read idle, went back to zero a
        # scrape later (a trickle of requests cold-started every one).
        stepped=stepped(prev, curr) if prev is not None else any(curr.steps_total.values()),
    )
