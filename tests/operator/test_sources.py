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
    """Each rank's page: rank r (port 8100 + r) at KV usage 0.2 + 0.2 r, r + 1 running."""

    async def sample(self, pod: str, url: str) -> PodSample | None:
        rank = int(url.rsplit(":", 1)[1]) - 8100
        if pod == "down" or url == "http://c:8101":
            return None
        return PodSample(
            pod=pod,
            ready=True,
            scraped_at=float(rank),
            kv_cache_usage=0.2 + 0.2 * rank,
            requests_running=rank + 1,
            requests_waiting=0,
            waiting_prompt_tokens=0,
            token_budget=8192,
            steps_total={"decode": 10.0 * (rank + 1)},
            step_seconds_total=1.0 + rank,
            started_at=100.0 + rank,
        )


@pytest.mark.asyncio
async def test_unreadable_pods_are_left_out_of_a_scrape():
    sources = MetricSources(samples=_Samples(), queues=RedisQueues("x"))
    samples = await sources.sample_all({"up": ("http://a:8100",), "down": ("http://b:8100",)})
    assert list(samples) == ["up"]


@pytest.mark.asyncio
async def test_a_data_parallel_pods_ranks_make_one_sample_and_one_unread_rank_none():
    sources = MetricSources(samples=_Samples(), queues=RedisQueues("x"))
    ranks = tuple(f"http://a:{8100 + r}" for r in range(3))
    samples = await sources.sample_all({"a": ranks, "c": ("http://c:8100", "http://c:8101")})
    assert list(samples) == ["a"]  # half of c's load read as its whole: wrong both ways
    pod = samples["a"]
    assert pod.kv_cache_usage == pytest.approx(0.4)  # the mean of equal pools
    assert (pod.requests_running, pod.token_budget) == (6, 8192)  # a step's budget: a rank's
    assert pod.steps_total == {"decode": 60.0}
    assert (pod.step_seconds_total, pod.started_at, pod.scraped_at) == (3.0, 102.0, 2.0)
