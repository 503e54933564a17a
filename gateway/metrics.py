"""The gateway's Prometheus metrics, on a CollectorRegistry of its own (one per app).

Latencies are what the client sees: TTFT from the request's arrival to the
first token chunk written to a stream, end-to-end until the last byte of the
response. Model labels only ever carry served model names (or "unknown"), so
callers cannot blow up the label set with made-up names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.protocol import PRIORITY_HIGH, PRIORITY_LOW, PRIORITY_NORMAL
from tandem.queue_state import QueueState
from tandem.registry_entry import EngineInfo

# Seconds: sub-millisecond gateway work up to minutes-long CPU generations, as long as
# --request-timeout's default (600 s) allows.
_LATENCY = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)  # fmt: skip

_PRIORITY_LABELS = {PRIORITY_HIGH: "high", PRIORITY_NORMAL: "normal", PRIORITY_LOW: "low"}

# The model label of a request that names no served model: an unknown name, a
# request refused before its model was looked up, a route not about a model.
UNKNOWN_MODEL = "unknown"

# Routes by their template; anything else is "other" (scanners hit random paths).
ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/models/{model}",
    "/healthz",
    "/readyz",
    "/metrics",
)


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "tandem_gateway_requests_total",
            "HTTP requests answered, by route, model and status code.",
            ["route", "model", "status"],
            registry=r,
        )
        self._latency = Histogram(
            "tandem_gateway_request_seconds",
            "End-to-end latency as the client sees it: arrival to the last byte.",
            ["route", "model"],
            buckets=_LATENCY,
            registry=r,
        )
        self._ttft = Histogram(
            "tandem_gateway_time_to_first_token_seconds",
            "Streaming requests: arrival to the first token chunk sent.",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self._queued_to_first_token = Histogram(
            "tandem_gateway_enqueue_to_first_token_seconds",
            "Enqueue to the first token from an engine (queueing, then the prefill), "
            "streamed or not; requests whose first event is an error are not counted.",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self._in_flight = Gauge(
            "tandem_gateway_requests_in_flight",
            "Requests being answered, by route.",
            ["route"],
            registry=r,
        )
        self._rejections = Counter(
            "tandem_gateway_rejections_total",
            "Requests refused before or instead of queueing, by reason.",
            ["reason"],
            registry=r,
        )
        self._engines = Gauge(
            "tandem_gateway_engines",
            "Live engines taking work (not draining) per served model and role, from the "
            "registry as of the scrape; a model scaled to zero, or whose engines are all "
            "gone, shows 0 for every role.",
            ["model", "role"],
            registry=r,
        )
        self._redis_up = Gauge(
            "tandem_gateway_redis_up",
            "1 if Redis answered the last read of the engine registry, else 0 (the "
            "engine counts are then the last read).",
            registry=r,
        )
        self._keys_stale = Gauge(
            "tandem_gateway_api_keys_stale",
            "1 while the API key file's last change could not be read: the keys from before "
            "it are in use (a key it revoked still passes; the log says why), else 0.",
            registry=r,
        )
        self._requeued = Counter(
            "tandem_gateway_requeued_total",
            "Work items queued again after a Redis restart lost them.",
            registry=r,
        )
        # (model, role) of every engine series shown once: kept at 0 when the
        # engines are gone, so dashboards and alerts see 0 rather than no data.
        self._engine_series: set[tuple[str, str]] = set()
        backlog = "as of the scrape (every gateway replica reports the same: aggregate with max)"
        self._queue_waiting = Gauge(
            "tandem_gateway_queue_waiting",
            f"Requests' work items in Redis no engine has taken yet, by priority, {backlog}.",
            ["model", "priority"],
            registry=r,
        )
        self._queue_tokens = Gauge(
            "tandem_gateway_queue_prompt_tokens",
            f"Estimated prompt tokens of the waiting work items, {backlog}.",
            ["model"],
            registry=r,
        )
        self._queue_pending = Gauge(
            "tandem_gateway_queue_pending",
            "Work items an engine took and has not finished (or a dead engine left for "
            f"another to claim), {backlog}.",
            ["model"],
            registry=r,
        )
        self._handoffs_waiting = Gauge(
            "tandem_gateway_handoffs_waiting",
            f"Prefilled requests no decode engine has taken yet, {backlog}.",
            ["model"],
            registry=r,
        )
        self._backlog_models: set[str] = set()
        self._cancellations = Counter(
            "tandem_gateway_cancellations_total",
            "Work items cancelled by the gateway, by why.",
            ["why"],
            registry=r,
        )
        # Per API key, by its name (never the key): what each tenant was delivered and
        # refused. The names are the keys file's (and "anonymous", "env-N"): no caller
        # makes one up.
        self._key_tokens = Counter(
            "tandem_gateway_key_tokens_total",
            "Tokens of the answers delivered whole, as their usage counts them (by each "
            "attempt that delivers one), by API key name, model and type (prompt or "
            "completion).",
            ["key", "model", "type"],
            registry=r,
        )
        self._key_rejections = Counter(
            "tandem_gateway_key_rejections_total",
            "Requests of a known API key refused, by its name and reason.",
            ["key", "reason"],
            registry=r,
        )

    def started(self, route: str) -> None:
        self._in_flight.labels(route).inc()

    def finished(self, route: str, model: str, status: int, seconds: float) -> None:
        self._in_flight.labels(route).dec()
        self._requests.labels(route, model, str(status)).inc()
        # Answered requests only: refusals (400s, 429s at overload) in it made the
        # latency percentiles fall as things got worse.
        if route not in ("/healthz", "/readyz", "/metrics") and status < 400:
            self._latency.labels(route, model).observe(seconds)

    def first_token(self, model: str, seconds: float) -> None:
        self._ttft.labels(model).observe(seconds)

    def enqueue_to_first_token(self, model: str, seconds: float) -> None:
        self._queued_to_first_token.labels(model).observe(seconds)

    def redis_up(self, up: bool) -> None:
        self._redis_up.set(1 if up else 0)

    def keys_stale_when(self, stale: Callable[[], bool]) -> None:
        """Read `stale` at each scrape for tandem_gateway_api_keys_stale."""
        self._keys_stale.set_function(lambda: 1.0 if stale() else 0.0)

    def rejected(self, reason: str, key: str | None = None) -> None:
        """A refusal, and the refusals of its caller's key name (None: not known)."""
        self._rejections.labels(reason).inc()
        if key is not None:
            self._key_rejections.labels(key, reason).inc()

    def key_usage(self, key: str, model: str, usage: Mapping[str, object]) -> None:
        """An answer delivered whole: its usage, charged to the key's name."""
        for kind in ("prompt", "completion"):
            tokens = usage[f"{kind}_tokens"]
            if isinstance(tokens, int) and tokens > 0:
                self._key_tokens.labels(key, model, kind).inc(tokens)

    def cancelled(self, why: str, count: int) -> None:
        self._cancellations.labels(why).inc(count)

    def requeued(self, count: int) -> None:
        self._requeued.inc(count)

    def engines(self, models: Mapping[str, Sequence[EngineInfo]]) -> None:
        """Set the engine counts to the directory's current view; a model/role seen
        before and now without engines (not served any more, too) shows 0."""
        counts = dict.fromkeys(self._engine_series, 0)
        for model, infos in models.items():
            for role in ("normal", "prompt", "completion"):
                counts.setdefault((model, role), 0)
            for info in infos:
                if not info.draining:
                    counts[model, info.role] = counts.get((model, info.role), 0) + 1
        self._engine_series = set(counts)
        for (model, role), count in counts.items():
            self._engines.labels(model, role).set(count)

    @property
    def backlog_models(self) -> frozenset[str]:
        """The models whose queue gauges were ever set."""
        return frozenset(self._backlog_models)

    def backlog(self, states: Mapping[str, QueueState]) -> None:
        """Set the queue gauges to these models' backlogs; a model shown before and not
        served any more shows 0 (its series stay, as the engine counts' do)."""
        empty = QueueState(dict.fromkeys(_PRIORITY_LABELS, 0), 0, 0, 0, 0)
        for model in self._backlog_models - set(states):
            self._set_backlog(model, empty)
        for model, state in states.items():
            self._set_backlog(model, state)
        self._backlog_models |= set(states)

    def _set_backlog(self, model: str, state: QueueState) -> None:
        for priority, label in _PRIORITY_LABELS.items():
            self._queue_waiting.labels(model, label).set(state.waiting.get(priority, 0))
        self._queue_tokens.labels(model).set(state.queued_tokens)
        self._queue_pending.labels(model).set(state.pending)
        self._handoffs_waiting.labels(model).set(state.handoff_waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
