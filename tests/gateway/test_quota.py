"""Token-bucket quotas in Redis: exact under concurrency, shared by replicas, refilling."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
import redis.asyncio as aioredis
from support.replicas import run_on_two_clients

from tandem import catalog
from tandem.gateway.auth import ApiKey, KeyStore
from tandem.gateway.errors import GatewayError
from tandem.gateway.quota import Quotas, _duration
from tandem.protocol import PRIORITY_NORMAL


def test_requests_per_minute_admit_exactly_the_limit_across_replicas(redis_url, keys):
    key = ApiKey("k", rpm=5)

    async def work(a, b):
        replicas = [Quotas(a, keys.prefix), Quotas(b, keys.prefix)]
        decisions = await asyncio.gather(
            *(replicas[i % 2].take(key, 0, f"r{i}") for i in range(20))
        )
        return decisions

    decisions = run_on_two_clients(redis_url, work)
    assert sum(d.admitted for d in decisions) == 5
    refused = [d for d in decisions if not d.admitted]
    assert {d.quota for d in refused} == {"rpm"}
    # One request comes back every 60/5 = 12 s.
    assert all(0 < d.retry_after <= 12.01 for d in refused)


def test_a_request_refused_for_tokens_uses_no_request(redis_url, keys):
    key = ApiKey("k", rpm=2, tpm=100)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        return [await quotas.take(key, cost, f"r{i}") for i, cost in enumerate((60, 60, 10, 1))]

    first, second, third, fourth = run_on_two_clients(redis_url, work)
    assert first.admitted and third.admitted
    assert (second.admitted, second.quota) == (False, "tpm")
    # 40 tokens left, 60 needed: 20 tokens at 100/60 per second.
    assert second.retry_after == pytest.approx(12, abs=0.2)
    assert (fourth.admitted, fourth.quota) == (False, "rpm")


def test_a_cost_above_the_whole_bucket_is_refused_for_good(redis_url, keys):
    key = ApiKey("k", tpm=100)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        decision = await quotas.take(key, 101, "r0")
        with pytest.raises(GatewayError) as caught:
            await quotas.admit(key, 101, "r1", 60.0)
        return decision, caught.value

    decision, error = run_on_two_clients(redis_url, work)
    assert decision.quota == "tpm_size"
    assert error.status == 429 and error.headers["x-should-retry"] == "false"
    assert "Retry-After" not in error.headers  # it never passes
    assert error.headers["x-ratelimit-remaining-tokens"] == "100"  # nothing taken
    assert "tokens per minute" in error.message and "101" in error.message


def test_buckets_refill_with_time(redis_url, keys):
    # One request back every second: the burst's 61 takes (~20 ms here) have a
    # second of slack on a loaded machine before one comes back early.
    key = ApiKey("k", rpm=60)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        burst = [await quotas.take(key, 0, f"r{i}") for i in range(61)]
        await asyncio.sleep(1.1)
        return burst, await quotas.take(key, 0, "later")

    burst, later = run_on_two_clients(redis_url, work)
    assert sum(d.admitted for d in burst) == 60 and not burst[-1].admitted
    assert later.admitted


def test_the_429_names_the_quota_and_says_when_to_retry(redis_url, keys):
    key = ApiKey("team-a", rpm=1)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        await quotas.admit(key, 0, "r0", 60.0)
        with pytest.raises(GatewayError) as caught:
            await quotas.admit(key, 0, "r1", 60.0)
        return caught.value

    error = run_on_two_clients(redis_url, work)
    # OpenAI's code and type: clients tell a key's rate limit from other 429s by them.
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert error.type == "requests" and error.reason == "rpm_exceeded"
    assert "requests per minute" in error.message and "team-a" in error.message
    assert 55 <= int(error.headers["Retry-After"]) <= 60
    # To the millisecond, which the SDKs read first (Retry-After rounds up to a second).
    assert int(error.headers["Retry-After"]) - 1 < int(error.headers["retry-after-ms"]) / 1000
    assert int(error.headers["retry-after-ms"]) / 1000 <= int(error.headers["Retry-After"])


def test_keys_without_limits_never_touch_redis(keys):
    async def work():
        client = aioredis.Redis.from_url("redis://127.0.0.1:1/0")  # nothing listens there
        try:
            return await Quotas(client, keys.prefix).take(ApiKey("free"), 10**9, "r0")
        finally:
            await client.aclose()

    assert asyncio.run(work()).admitted


def test_a_take_run_again_for_the_same_request_takes_nothing_twice(redis_url, keys):
    # The client reruns a script whose reply a dead connection lost: the request must
    # be admitted, and charged once.
    key = ApiKey("k", rpm=2, tpm=100)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        first = await quotas.take(key, 60, "r0")
        again = await quotas.take(key, 60, "r0")
        other = await quotas.take(key, 30, "r1")  # 40 tokens and 1 request were left
        return first, again, other

    first, again, other = run_on_two_clients(redis_url, work)
    assert first.admitted and again.admitted and other.admitted


def test_a_give_back_returns_what_its_take_took_once(redis_url, keys):
    key = ApiKey("k", rpm=2, tpm=100)

    async def work(a, b):
        quotas, other = Quotas(a, keys.prefix), Quotas(b, keys.prefix)
        assert (await quotas.take(key, 80, "r1")).admitted
        await quotas.give_back(key, 80, "r1")
        await other.give_back(key, 80, "r1")  # again, from another replica: nothing
        await quotas.give_back(key, 80, "never-taken")  # nothing to give back
        taken = [await quotas.take(key, 80, f"s{i}") for i in range(2)]
        return taken

    first, second = run_on_two_clients(redis_url, work)
    assert first.admitted  # the 80 tokens and the request came back, once
    assert (second.admitted, second.quota) == (False, "tpm")


def test_a_give_back_may_keep_the_request_slot(redis_url, keys):
    key = ApiKey("k", rpm=1, tpm=100)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        assert (await quotas.take(key, 80, "r1")).admitted
        await quotas.give_back(key, 80, "r1", request_slot=False)
        return await quotas.take(key, 80, "r2")

    again = run_on_two_clients(redis_url, work)
    assert (again.admitted, again.quota) == (False, "rpm")  # the tokens came back, not it


def test_a_settlement_gives_back_unused_tokens_and_charges_undercounted_ones(redis_url, keys):
    key = ApiKey("k", tpm=100)

    async def work(a, b):
        quotas, other = Quotas(a, keys.prefix), Quotas(b, keys.prefix)
        assert (await quotas.take(key, 80, "short")).admitted
        await quotas.settle(key, 80, 20, "short")  # 60 of max_tokens unused
        await other.settle(key, 80, 20, "short")  # again, from another replica: nothing
        fits = await quotas.take(key, 70, "next")  # 80 left: it fits only after the settling
        await quotas.settle(key, 70, 250, "next")  # a CJK prompt counted at a quarter
        return fits, await quotas.take(key, 1, "after")

    fits, after = run_on_two_clients(redis_url, work)
    assert fits.admitted
    # 100 - 20 - 250 = -170: one token needs 171 at 100/60 a second.
    assert (after.admitted, after.quota) == (False, "tpm")
    assert after.retry_after == pytest.approx(171 * 60 / 100, abs=1)


def test_a_bucket_below_zero_outlives_a_minute(redis_url, keys):
    # Its key expired after 60 s like a full one's would: the debt was forgotten.
    key = ApiKey("k", tpm=100)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        await quotas.take(key, 10, "r")
        await quotas.settle(key, 10, 300, "r")
        return await a.pttl(quotas.bucket_keys(key.name)[1])

    # -200 refills to 100 in 3 minutes.
    assert run_on_two_clients(redis_url, work) == pytest.approx(180_000, abs=1_000)


def test_nothing_is_settled_after_a_give_back(redis_url, keys):
    key = ApiKey("k", tpm=100)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        await quotas.take(key, 50, "r")
        await quotas.give_back(key, 50, "r")
        await quotas.settle(key, 50, 90, "r")  # a late settlement must not charge again
        return await quotas.take(key, 100, "whole")

    # All 100 were back: 60 had the 40 been charged.
    assert run_on_two_clients(redis_url, work).admitted


def test_a_take_can_be_given_back_until_the_requests_deadline(redis_url, keys):
    # An engine refuses a request (too long a prompt) as it takes it from the queue, at
    # any time until its deadline: with a minute's marker, a request refused after a
    # longer wait kept its charge.
    key = ApiKey("k", rpm=2, tpm=100)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        await quotas.take(key, 10, "short", hold_s=5.0)  # at least a minute, as before
        await quotas.take(key, 10, "long", hold_s=600.0)
        return [await a.pttl(quotas.marker_key(key.name, rid)) for rid in ("short", "long")]

    short, long = run_on_two_clients(redis_url, work)
    assert short == pytest.approx(60_000, abs=1_000)
    assert long == pytest.approx(600_000, abs=1_000)


def test_a_request_whose_work_could_not_be_queued_uses_no_quota(
    start_gateway, redis_client, keys, tmp_path, monkeypatch
):
    # The quota is taken before the work is written; a write Redis refused answered
    # 5xx and kept the charge, against "a refused request uses no quota".
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "sk-tpm", "name": "team", "tpm": 100}]))
    gateway = start_gateway(KeyStore.load(str(path), None))  # in this process
    catalog.declare(redis_client, keys, "idle", "test/idle", ttl_s=60)
    first = uuid.UUID(int=7)
    monkeypatch.setattr(uuid, "uuid4", lambda: first)  # the first request's ids
    # The request's queued marker of the wrong type: the enqueue script fails before
    # it writes anything.
    redis_client.hset(keys.enqueued("idle", first.hex), "x", "1")
    body = {"model": "idle", "prompt": "hi", "max_tokens": 60}
    with gateway.http("sk-tpm", timeout=10) as http:
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code >= 500, refused.text
        assert redis_client.xlen(keys.work_stream("idle", PRIORITY_NORMAL)) == 0
        monkeypatch.undo()
        # 100 tokens a minute: with the first 61 still charged, this one would be a 429.
        again = http.post("/v1/completions", json=body, headers={"X-Tandem-Timeout": "0.5"})
    assert again.status_code == 504, again.text  # admitted, queued, nobody served it


def test_the_rate_limit_headers_say_what_is_left_and_when_it_is_full(redis_url, keys):
    # OpenAI's x-ratelimit-* headers, by which clients pace themselves.
    key = ApiKey("k", rpm=10, tpm=1000)

    async def work(a, _):
        quotas = Quotas(a, keys.prefix)
        admitted = await quotas.admit(key, 100, "r0", 60.0)
        with pytest.raises(GatewayError) as caught:
            await quotas.admit(key, 950, "r1", 60.0)
        again = await quotas.admit(key, 100, "r0", 60.0)  # its reply lost: run again
        return admitted, caught.value.headers, again

    admitted, refused, again = run_on_two_clients(redis_url, work)
    assert admitted["x-ratelimit-limit-requests"] == "10"
    assert admitted["x-ratelimit-remaining-requests"] == "9"
    assert admitted["x-ratelimit-limit-tokens"] == "1000"
    assert admitted["x-ratelimit-remaining-tokens"] == "900"
    # Full buckets: a request of 10 a minute refills in 6 s, 100 tokens of 1,000 too.
    assert admitted["x-ratelimit-reset-requests"] == "6s"
    assert admitted["x-ratelimit-reset-tokens"] == "6s"
    assert refused["x-ratelimit-remaining-tokens"] == "900"  # refused: nothing taken
    assert refused["x-ratelimit-remaining-requests"] == "9"
    assert again == {}  # what is left is not known to an admission run again


@pytest.mark.parametrize(
    ("seconds", "written"),
    [(0.0, "0s"), (0.0201, "21ms"), (1.5, "1.5s"), (59.25, "59.25s"), (360, "6m0s"),
     (61.5, "1m1.5s")],
)  # fmt: skip
def test_reset_times_are_written_as_openai_writes_them(seconds, written):
    assert _duration(seconds) == written
