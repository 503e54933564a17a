"""A replica answers at most its limit of completion requests at once and sheds the
next with a 503 (each waiting request holds one of its Redis connections: past the
pool, every request of the replica failed mid-way, its work queued for nobody)."""

from __future__ import annotations

import threading

import redis
from support.polling import eventually

from tandem.engine.service.registry import Registry
from tandem.gateway.settings import GatewaySettings
from tandem.registry_entry import EngineInfo

# A model an engine is registered for that takes no work: its requests wait.
WAITING = "ghost-waiting"


def test_past_its_limit_a_replica_sheds_completion_requests(start_gateway, redis_url, keys):
    with redis.Redis.from_url(redis_url) as conn:
        Registry(conn, keys, ttl_seconds=600).heartbeat(
            EngineInfo("ghost", WAITING, "normal", "127.0.0.1:1")
        )
    gateway = start_gateway(max_answering=2)
    ask = {"model": WAITING, "prompt": "x", "max_tokens": 1}
    slow = {"X-Tandem-Timeout": "3"}
    with gateway.http() as client:
        answers: list[int] = []
        waiting = [
            threading.Thread(
                target=lambda: answers.append(
                    client.post("/v1/completions", json=ask, headers=slow).status_code
                )
            )
            for _ in range(2)
        ]
        for thread in waiting:
            thread.start()
        in_flight = {"route": "/v1/completions"}
        assert eventually(
            lambda: gateway.metric("tandem_gateway_requests_in_flight", **in_flight) == 2
        )
        shed = client.post("/v1/completions", json=ask)
        assert shed.status_code == 503 and shed.headers["Retry-After"] == "1"
        assert shed.json()["error"]["code"] == "overloaded"
        assert client.get("/v1/models").status_code == 200  # other routes are not held
        for thread in waiting:
            thread.join()
        assert answers == [504, 504]  # their deadlines
        # Their places free again: the next is answered (its deadline too, here).
        again = client.post("/v1/completions", json=ask, headers={"X-Tandem-Timeout": "0.2"})
        assert again.status_code == 504
    assert gateway.metric("tandem_gateway_rejections_total", reason="overloaded") == 1


def test_the_limit_defaults_to_twice_the_redis_pool():
    assert GatewaySettings().answering_limit == 2048  # 1,024 connections
    assert GatewaySettings(redis_max_connections=2).answering_limit == 4
    assert GatewaySettings(max_answering=5).answering_limit == 5
