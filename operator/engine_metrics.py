"""Engine metrics for the autoscaler: scrape an engine's /metrics into a PodSample.

The samples, and the rates and load made of two of them, are pod_load.py's
(pure). Direct scraping is the default (no Prometheus needed, and `tandem up`
has none); a Prometheus server can stand in through sources.SampleSource: the
same samples, read with instant queries instead of HTTP GETs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.operator.pod_load import SCRAPE_LOG, PodSample

log = logging.getLogger(SCRAPE_LOG)

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
        kv_receiving_requests=count("kv_receiving_requests"),
        handoffs_parked=count("handoffs_parked"),
        # 0: a page rendered before the engine's first turn set it; absent: an older engine.
        max_running_requests=count("max_running_requests") or None,
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


# ------------------------------------------------------------------ scraping


# An engine's page is a few kilobytes (a few hundred series); each rank's of a
# data-parallel pod the same.
MAX_BODY_BYTES = 4 << 20


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
        status, text = metrics
        if status != 200:
            raise ValueError(f"/metrics answered {status}")
        ready = isinstance(readyz, tuple) and readyz[0] == 200
        return parse_metrics(text, pod=pod, ready=ready, scraped_at=time.monotonic())
    except (httpx.HTTPError, TimeoutError, ValueError) as exc:
        # ValueError: a page that is not Prometheus text, not an engine's, or
        # holding a value out of range.
        # DEBUG: a pod failing is routine; scaling.evaluate warns once per role.
        log.debug("scrape of %s at %s failed: %r", pod, base, exc)
        return None


async def _get(client: httpx.AsyncClient, url: str, timeout: float) -> tuple[int, str]:
    """The status and body of a GET, the body at most MAX_BODY_BYTES (ValueError past it)."""
    # httpx's timeout bounds each connect and each read, not the request: an
    # engine (or proxy) sending a byte a second would hold a scrape for minutes.
    async with asyncio.timeout(timeout), client.stream("GET", url, timeout=timeout) as response:
        body = bytearray()
        # A pod runs its spec's image: a page of gigabytes must not take the
        # operator's memory, and every model's autoscaling with it.
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ValueError(f"{url} sent more than {MAX_BODY_BYTES} bytes")
        return response.status_code, body.decode("utf-8", errors="replace")
