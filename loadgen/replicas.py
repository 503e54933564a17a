"""Replicas per role over a run: from a Tandem gateway's /metrics, or its engine registry.

Tandem's gateway exports `tandem_gateway_engines{model,role}` (live, not
draining engines, as of the scrape), so by default the bench polls the
gateway it loads; a server that is not Tandem has no such metric and the run
simply has no replica timeline. With --redis-url the bench reads the engine
registry itself (`{prefix}:engines` and one `{prefix}:engine:{id}` key per
engine; docs/protocol.md), read-only: it never prunes expired ids, the gateway
and the autoscaler do that. Draining engines are not counted either way: they
take no new work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from tandem.keys import Keys
from tandem.loadgen.client import described
from tandem.protocol import ProtocolError, as_text
from tandem.registry_entry import EngineInfo

ENGINES_METRIC = "tandem_gateway_engines"


@dataclass(frozen=True)
class ReplicaSample:
    # Seconds after the run's start.
    t_s: float
    # Live, not draining engines of the model, by role (normal, prompt, completion).
    roles: dict[str, int]


def count_roles(entries: list[bytes | str | None], model: str) -> dict[str, int]:
    """Roles of the live, not draining engines of `model`, from registry entries (None: expired)."""
    counts: dict[str, int] = {}
    for raw in entries:
        if raw is None:
            continue
        try:
            info = EngineInfo.from_fields(json.loads(raw))
        except (ProtocolError, ValueError, TypeError, AttributeError):
            continue  # another protocol version: not ours to count
        if info.model == model and not info.draining:
            counts[info.role] = counts.get(info.role, 0) + 1
    return counts


def roles_from_metrics(text: str, model: str) -> dict[str, int] | None:
    """Engines of `model` by role (roles with none left out) from a gateway's /metrics
    text; None when the text has no such metric (not a Tandem gateway)."""
    counts: dict[str, int] | None = None
    for family in text_string_to_metric_families(text):
        if family.name != ENGINES_METRIC:
            continue
        counts = {}
        for sample in family.samples:
            if sample.labels.get("model") == model and sample.value > 0:
                counts[sample.labels["role"]] = int(sample.value)
    return counts


def metrics_url(base_url: str) -> str:
    """The gateway's /metrics beside its OpenAI API: http://h:p/v1 -> http://h:p/metrics."""
    root = base_url.rstrip("/")
    root = root.removesuffix("/v1")
    return f"{root}/metrics"


class RegistrySource:
    """Counts from the engine registry in the deployment's Redis."""

    def __init__(self, redis_url: str, prefix: str, model: str) -> None:
        self.client = aioredis.Redis.from_url(redis_url, socket_timeout=2)
        self.keys = Keys(prefix=prefix)
        self.model = model

    async def __call__(self) -> dict[str, int]:
        ids = sorted(await self.client.smembers(self.keys.engines_set))
        if not ids:
            return {}
        names = [self.keys.engine_key(as_text(i)) for i in ids]
        return count_roles(await self.client.mget(names), self.model)

    async def close(self) -> None:
        await self.client.aclose()


class GatewayMetricsSource:
    """Counts from the gateway's own /metrics (the URL's /v1 replaced by /metrics)."""

    def __init__(
        self,
        metrics_url: str,
        model: str,
        headers: dict[str, str],
        transport: httpx.AsyncBaseTransport | None = None,  # tests: no network
    ) -> None:
        self.client = httpx.AsyncClient(headers=headers, timeout=5, transport=transport)
        self.metrics_url = metrics_url
        self.model = model

    async def __call__(self) -> dict[str, int]:
        response = await self.client.get(self.metrics_url)
        if response.status_code == 404:  # a server without /metrics: not httpx's paragraph
            raise LookupError(f"{self.metrics_url} answers 404: not a Tandem gateway")
        response.raise_for_status()
        counts = roles_from_metrics(response.text, self.model)
        if counts is None:
            raise LookupError(f"{self.metrics_url} has no {ENGINES_METRIC}: not a Tandem gateway")
        return counts

    async def close(self) -> None:
        await self.client.aclose()


Source = RegistrySource | GatewayMetricsSource


class ReplicaPoller:
    """Samples a source every `interval_s` until stopped."""

    def __init__(self, source: Source, interval_s: float = 1.0) -> None:
        if not interval_s > 0:
            raise ValueError(f"--replica-poll-s must be > 0, got {interval_s}")
        self.source = source
        self.interval_s = interval_s
        self.samples: list[ReplicaSample] = []
        # The last error, so a run that could not read replicas says why.
        self.error: str | None = None

    async def run(self, run_start: float, stop: asyncio.Event) -> None:
        while True:
            try:
                roles = await self.source()
                self.samples.append(ReplicaSample(time.perf_counter() - run_start, roles))
            except (RedisError, OSError, httpx.HTTPError, LookupError) as exc:
                self.error = described(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            if stop.is_set():
                return

    async def close(self) -> None:
        await self.source.close()
