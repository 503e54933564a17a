"""The engine's Prometheus metrics: what the operator scales on (docs/metrics.md).

One CollectorRegistry per engine (no process-wide default registry), so two
engines in one test process never mix their numbers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from tandem.engine.engine import Engine
from tandem.engine.engine_output import EngineTotals
from tandem.engine.service.time_integral import TimeIntegral

# Latency buckets in seconds: millisecond decode steps of small models on GPUs (a first
# bucket of 5 ms held most of them) to minutes-long CPU prefills and requests.
_LATENCY = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)  # fmt: skip
# A token's time and a step's: tens of milliseconds, where _LATENCY had only 10/25/50/100
# ms and a p95 between 50 and 100 ms could read twice what it was.
_PER_TOKEN = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 1, 2.5, 5, 10, 30,
)  # fmt: skip
# Past 10 s (--kv-fetch-timeout's default) too: a deployment that raises it sees where
# its slow fetches fall, not one +Inf bucket.
_TRANSFER = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Drafts accepted per sequence in a step, a mean over the step's sequences (so
# fractional), up to numSpeculativeTokens' most, 16.
_DRAFTS = (0, 0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16)


class EngineMetrics:
    def __init__(self, model: str, role: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model": model, "role": role}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r).labels(**labels)

        def integral(name: str, doc: str, value: Callable[[], float]) -> None:
            r.register(_IntegralCollector(name, doc, labels, value))

        self._labels = labels
        self.kv_cache_usage = gauge(
            "tandem_engine_kv_cache_usage", "Fraction of KV cache blocks in use (0-1)."
        )
        self.requests_running = gauge("tandem_engine_requests_running", "Requests decoding.")
        self.requests_waiting = gauge(
            "tandem_engine_requests_waiting", "Requests queued in the engine for prefill."
        )
        self.waiting_prompt_tokens = gauge(
            "tandem_engine_waiting_prompt_tokens", "Prompt tokens still to prefill in the engine."
        )
        # Its time integral, read at each scrape: the autoscaler rates it into the
        # interval's mean, which the gauge's swing around prompt steps hides.
        self._clock = clock
        self.waiting_token_seconds = TimeIntegral(clock())
        integral(
            "tandem_engine_waiting_prompt_token_seconds_total",
            "Prompt tokens waiting in the engine, integrated over time (token-seconds): "
            "its rate is the mean of tandem_engine_waiting_prompt_tokens.",
            lambda: self.waiting_token_seconds.total(self._clock()),
        )
        self.kv_receiving_requests = gauge(
            "tandem_engine_kv_receiving_requests",
            "COMPLETION engine: handoffs whose KV is being fetched (their blocks held).",
        )
        self.kv_pinned_requests = gauge(
            "tandem_engine_kv_pinned_requests", "PROMPT engine: prefilled KV awaiting a decoder."
        )
        self.handoffs_parked = gauge(
            "tandem_engine_handoffs_parked",
            "COMPLETION engine: handoffs taken that wait for KV room to admit them.",
        )
        self.token_budget = gauge(
            "tandem_engine_token_budget", "max_num_batched_tokens: the token budget of a step."
        )
        self.max_running_requests = gauge(
            "tandem_engine_max_running_requests",
            "Sequence slots: the most requests running at once (max_num_seqs, or a decode "
            "budget below it).",
        )
        self.budget_utilization = gauge(
            "tandem_engine_budget_utilization",
            "Scheduled tokens of the last step over the budget (rate of "
            "scheduled_tokens_total / steps_total / budget gives the mean).",
        )
        self._steps = counter("tandem_engine_steps_total", "Engine steps by kind.", ("kind",))
        self._scheduled = counter(
            "tandem_engine_scheduled_tokens_total", "Tokens computed, by step kind.", ("kind",)
        )
        self.prefix_queries = counter(
            "tandem_engine_prefix_cache_queries_total", "Prompt tokens looked up in the cache."
        ).labels(**labels)
        self.prefix_hits = counter(
            "tandem_engine_prefix_cache_hits_total", "Prompt tokens served from the prefix cache."
        ).labels(**labels)
        self.preemptions = counter(
            "tandem_engine_preemptions_total", "Requests preempted to free KV (recomputed later)."
        ).labels(**labels)
        self.drafts_proposed = counter(
            "tandem_engine_spec_drafts_total", "Speculative draft tokens verified."
        ).labels(**labels)
        self.drafts_accepted = counter(
            "tandem_engine_spec_accepted_total", "Speculative draft tokens accepted."
        ).labels(**labels)
        self.accepted_per_step = histogram(
            "tandem_engine_spec_accepted_per_step",
            "Drafts accepted per sequence in a decode step (the step's mean).",
            _DRAFTS,
        )
        self.ttft = histogram(
            "tandem_engine_time_to_first_token_seconds",
            "From the gateway queueing a request to its first token.",
            _LATENCY,
        )
        self.tpot = histogram(
            "tandem_engine_time_per_output_token_seconds",
            "Mean time between output tokens of a finished request.",
            _PER_TOKEN,
        )
        self.step_seconds = histogram(
            "tandem_engine_step_seconds", "Wall time of one engine step.", _PER_TOKEN
        )
        self._requests = counter(
            "tandem_engine_requests_total", "Requests ended, by outcome.", ("outcome",)
        )
        # As the finished requests' usage says: what a client is billed, once per choice.
        self.prompt_tokens = counter(
            "tandem_engine_prompt_tokens_total",
            "Prompt tokens of the choices this engine finished (cached ones too; each choice "
            "of a request with n > 1 counts its prompt).",
        ).labels(**labels)
        self.generation_tokens = counter(
            "tandem_engine_generation_tokens_total",
            "Output tokens of the requests this engine finished (their usage).",
        ).labels(**labels)
        self.kv_transfer_bytes = counter(
            "tandem_engine_kv_transfer_bytes_total", "KV bytes received from PROMPT engines."
        ).labels(**labels)
        self.kv_transfer_seconds = histogram(
            "tandem_engine_kv_transfer_seconds", "Time to fetch one request's KV.", _TRANSFER
        )
        self._kv_failures = counter(
            "tandem_engine_kv_transfer_failures_total",
            "KV fetches that failed (the prompt was recomputed), by reason.",
            ("reason",),
        )
        self.kv_served_bytes = counter(
            "tandem_engine_kv_served_bytes_total", "KV bytes sent to COMPLETION engines."
        ).labels(**labels)
        self._kv_serve_failures = counter(
            "tandem_engine_kv_serve_failures_total",
            "KV fetches a PROMPT engine did not serve to their end, by reason.",
            ("reason",),
        )
        # The engine totals at the last observe_step, to turn them into increments.
        self._seen = EngineTotals()

    def request_ended(self, outcome: str) -> None:
        self._requests.labels(**self._labels, outcome=outcome).inc()

    def kv_transfer_failed(self, reason: str) -> None:
        self._kv_failures.labels(**self._labels, reason=reason).inc()

    def kv_serve_failed(self, reason: str) -> None:  # from the KV server's threads
        self._kv_serve_failures.labels(**self._labels, reason=reason).inc()

    def observe_step(self, engine: Engine) -> None:
        """After each step: counters from the engine's totals, gauges from the scheduler."""
        step, totals, seen = engine.last_step, engine.totals, self._seen
        # A data-parallel rank with no work steps empty, in lockstep with the others:
        # not a step of its own. Counted, it would dilute the budget's use and count
        # waiting at the vote as busy time.
        if step.num_seqs:
            kind = "prefill" if step.is_prefill else "decode"
            self._steps.labels(**self._labels, kind=kind).inc()
            self._scheduled.labels(**self._labels, kind=kind).inc(step.num_scheduled_tokens)
            self.step_seconds.observe(step.seconds)
            budget = engine.scheduler.config.max_num_batched_tokens
            self.budget_utilization.set(step.num_scheduled_tokens / budget)
        self.prefix_queries.inc(totals.admitted_tokens - seen.admitted_tokens)
        self.prefix_hits.inc(totals.prefix_cached_tokens - seen.prefix_cached_tokens)
        self.preemptions.inc(totals.preemptions - seen.preemptions)
        proposed = totals.drafts_proposed - seen.drafts_proposed
        accepted = totals.drafts_accepted - seen.drafts_accepted
        self.drafts_proposed.inc(proposed)
        self.drafts_accepted.inc(accepted)
        if proposed:
            self.accepted_per_step.observe(accepted / max(step.num_seqs, 1))
        self._seen = dataclasses.replace(totals)
        self.observe_queues(engine)

    def observe_queues(self, engine: Engine) -> None:
        sched = engine.scheduler
        self.kv_cache_usage.set(sched.kv_usage)
        self.requests_running.set(sched.num_running)
        self.requests_waiting.set(sched.num_waiting)
        waiting = sched.waiting_prompt_tokens
        self.waiting_prompt_tokens.set(waiting)
        self.waiting_token_seconds.set(waiting, self._clock())
        self.kv_pinned_requests.set(len(sched.handoff))
        self.kv_receiving_requests.set(len(sched.receiving))
        self.token_budget.set(sched.config.max_num_batched_tokens)
        self.max_running_requests.set(sched.config.max_running)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _IntegralCollector:
    """A counter whose value is computed at each scrape (a TimeIntegral's total)."""

    def __init__(
        self, name: str, doc: str, labels: dict[str, str], value: Callable[[], float]
    ) -> None:
        self._name, self._doc, self._labels, self._value = name, doc, labels, value

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), self._value())
        yield family
