"""Operator tests run against an emulated API server (support/kube_api.py), kopf included.

`cluster` is the emulated API with its workload controllers; `operator` adds
one operator replica whose autoscaler reads `metrics` (fake engine gauges and
queue depths) and `clock` (fake time for the scaling windows).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from support.kube_api import ApiServer
from support.kube_cluster import Cluster, OperatorReplica

from tandem.operator.crd import root_schema
from tandem.operator.pod_load import PodSample
from tandem.operator.sources import MetricSources
from tandem.protocol import PRIORITIES
from tandem.queue_state import QueueState


class FakeMetrics:
    """A SampleSource and QueueSource whose numbers the test sets (read from the operator's
    thread: plain attribute reads and writes, atomic under the GIL)."""

    def __init__(self) -> None:
        # KV cache usage by pod-name prefix (longest match wins), e.g. {"m-decode": 0.9}.
        self.kv: dict[str, float] = {}
        self.default_kv = 0.5
        self.running = 4
        self.queued_tokens = 0
        self.queue_reads: list[tuple[str, str]] = []
        # Catalog declarations: (redis_url, served model name, owner).
        self.declarations: list[tuple[str, str, str]] = []
        # Every scrape fails (a NetworkPolicy on the engines' port, engines that hang).
        self.unreadable = False
        # The pods whose scrapes fail (busy ones timing out, say).
        self.silent: set[str] = set()
        # Every queue read fails (Redis down).
        self.redis_down = False

    async def sample(self, pod: str, url: str) -> PodSample | None:
        if self.unreadable or pod in self.silent:
            return None
        prefixes = sorted((p for p in self.kv if pod.startswith(p)), key=len, reverse=True)
        return PodSample(
            pod=pod,
            ready=True,
            scraped_at=time.monotonic(),
            kv_cache_usage=self.kv[prefixes[0]] if prefixes else self.default_kv,
            requests_running=self.running,
            requests_waiting=0,
            waiting_prompt_tokens=0,
            token_budget=8192,
        )

    async def declare(self, redis_url: str, model: str, owner: str, ttl_s: float) -> None:
        self.declarations.append((redis_url, model, owner))

    async def depth(self, redis_url: str, model: str) -> QueueState:
        if self.redis_down:
            raise ConnectionError(f"{redis_url}: connection refused")
        self.queue_reads.append((redis_url, model))
        return QueueState(
            waiting=dict.fromkeys(PRIORITIES, 0),
            pending=0,
            queued_tokens=self.queued_tokens,
            handoff_waiting=0,
            handoff_pending=0,
        )


class FakeClock:
    """The autoscaler's monotonic clock, advanced by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def metrics() -> FakeMetrics:
    return FakeMetrics()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with Cluster(ApiServer(crd_schema=root_schema())) as emulated:
        yield emulated


@pytest_asyncio.fixture
async def operator(cluster: Cluster, metrics: FakeMetrics, clock: FakeClock) -> OperatorReplica:
    return await cluster.start_operator(lambda: MetricSources(metrics, metrics), clock=clock)
