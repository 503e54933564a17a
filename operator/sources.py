"""Where the autoscaler's numbers come from: engine /metrics and the model's Redis queues.

Both are Protocols so that tests drive the operator with fake numbers; in
production `SampleSource` is DirectScrape (engine_metrics.scrape: HTTP GET of
each engine pod's /metrics on port 8100) and `QueueSource` is RedisQueues
(tandem.backlog.queue_depth, one MULTI round trip per model).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import redis

from tandem import catalog
from tandem.backlog import queue_depth
from tandem.keys import Keys
from tandem.operator.engine_metrics import DEFAULT_TIMEOUT_S, scrape
from tandem.operator.pod_load import PodSample, combine_ranks
from tandem.queue_state import QueueState

# The Redis client may wait this long for a queue depth; a slow Redis skips one evaluation.
_REDIS_TIMEOUT_S = 2.0


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


# Pods scraped at once, every model's together (kopf starts their timers in step): each
# takes two connections of the client's pool.
MAX_CONCURRENT_SCRAPES = 32


@dataclass(frozen=True, slots=True)
class DirectScrape:
    """The default SampleSource: GET each engine's /metrics."""

    client: httpx.AsyncClient
    timeout: float = DEFAULT_TIMEOUT_S
    # A pod's timeout starts once it has its slot: hundreds of pods started at once
    # spent their whole budget queued for the pool, and every one read as unreadable.
    slots: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(MAX_CONCURRENT_SCRAPES)
    )

    async def sample(self, pod: str, url: str) -> PodSample | None:
        async with self.slots:
            return await scrape(self.client, url, pod, timeout=self.timeout)


class QueueSource(Protocol):
    """A model's backlog in the Redis it is served from, and its entry in the catalog there."""

    async def depth(self, redis_url: str, model: str) -> QueueState: ...

    async def declare(self, redis_url: str, model: str, owner: str, ttl_s: float) -> None:
        """Keep `model` in the catalog (tandem/catalog.py): gateways queue its requests even
        while it has no engine, which is what lets it scale up from zero."""
        ...


class RedisQueues:
    """QueueSource over real Redis servers, one client per URL (models may use their own Redis)."""

    def __init__(self, key_prefix: str) -> None:
        self._keys = Keys(key_prefix)
        self._clients: dict[str, redis.Redis] = {}

    async def depth(self, redis_url: str, model: str) -> QueueState:
        # queue_depth is the engines' own synchronous code; a thread keeps kopf's loop free.
        return await asyncio.to_thread(queue_depth, self._client(redis_url), self._keys, model)

    async def declare(self, redis_url: str, model: str, owner: str, ttl_s: float) -> None:
        client = self._client(redis_url)
        await asyncio.to_thread(catalog.declare, client, self._keys, model, owner, ttl_s)

    def _client(self, redis_url: str) -> redis.Redis:
        client = self._clients.get(redis_url)
        if client is None:
            client = redis.Redis.from_url(
                redis_url,
                socket_timeout=_REDIS_TIMEOUT_S,
                socket_connect_timeout=_REDIS_TIMEOUT_S,
            )
            self._clients[redis_url] = client
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


@dataclass(frozen=True)
class MetricSources:
    """The autoscaler's two inputs."""

    samples: SampleSource
    queues: QueueSource

    async def sample_all(self, targets: Mapping[str, Sequence[str]]) -> dict[str, PodSample]:
        """Scrape every pod (name -> its ranks' base URLs) at once, each pod's ranks as
        one sample; pods with a rank that cannot be read are left out."""
        names = list(targets)
        results = await asyncio.gather(*(self._sample_pod(n, targets[n]) for n in names))
        return {name: s for name, s in zip(names, results, strict=True) if s is not None}

    async def _sample_pod(self, pod: str, urls: Sequence[str]) -> PodSample | None:
        return await sample_ranks(lambda url: self.samples.sample(pod, url), urls)


async def sample_ranks(
    sample: Callable[[str], Awaitable[PodSample | None]], urls: Sequence[str]
) -> PodSample | None:
    """One pod's sample from its ranks' (their base URLs, rank 0 first), read at once;
    None if a rank cannot be read (half a pod's load read as its whole is wrong both
    ways)."""
    ranks = await asyncio.gather(*(sample(url) for url in urls))
    if not ranks or any(r is None for r in ranks):
        return None
    return combine_ranks(ranks)  # type: ignore[arg-type]


class _HttpScrape(DirectScrape):
    """DirectScrape that owns its HTTP client (closed with the operator)."""

    async def aclose(self) -> None:
        await self.client.aclose()


def production_sources(key_prefix: str, scrape_timeout_s: float) -> MetricSources:
    """HTTP scraping of engine pods and Redis queue depths. Call inside the running loop."""
    # Engines are reached by pod IP over plain HTTP; no proxy from the environment applies.
    limits = httpx.Limits(max_connections=2 * MAX_CONCURRENT_SCRAPES)
    client = httpx.AsyncClient(trust_env=False, limits=limits)
    return MetricSources(
        samples=_HttpScrape(client, timeout=scrape_timeout_s),
        queues=RedisQueues(key_prefix),
    )


async def close_sources(sources: MetricSources) -> None:
    for part in (sources.samples, sources.queues):
        close = getattr(part, "aclose", None)
        if close is not None:
            await close()
