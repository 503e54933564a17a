"""The autoscaler's production inputs: queue depths from a real Redis, scrapes gathered."""

from __future__ import annotations

import pytest

from tandem.backlog import enqueue
from tandem.operator.pod_load import PodSample
from tandem.operator.sources import MetricSources, RedisQueues
from tandem.protocol import WorkItem


@pytest.mark.asyncio
async def test_redis_queues_read_the_models_backlog(redis_url, redis_client, keys):
    for n in range(3):
        item = WorkItem(request_id=f"r{n}", model="m", prompt="hi", estimated_prompt_tokens=100)
        enqueue(redis_client, keys, item)
    queues = RedisQueues(keys.prefix)
    try:
        state = await queues.depth(redis_url, "m")
        other = await queues.depth(redis_url, "another-model")
    finally:
        await queues.aclose()
    assert state.total_waiting == 3 and state.queued_tokens == 300 and state.pending == 0
    assert other.total_waiting == 0 and other.queued_tokens == 0


class _Samples:
    async def sample(self, pod: str, url: str) -> PodSample | None:
        if pod == "down":
            return None
        return PodSample(
            pod=pod,
            ready=True,
            scraped_at=0.0,
            kv_cache_usage=0.5,
            requests_running=1,
            requests_waiting=0,
            waiting_prompt_tokens=0,
            token_budget=8192,
        )


@pytest.mark.asyncio
async def test_unreadable_pods_are_left_out_of_a_scrape():
    sources = MetricSources(samples=_Samples(), queues=RedisQueues("x"))
    samples = await sources.sample_all({"up": "http://a:8100", "down": "http://b:8100"})
    assert list(samples) == ["up"]
