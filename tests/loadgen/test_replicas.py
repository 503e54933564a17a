"""Replicas per role: from registry entries or a gateway's /metrics; live, not draining."""

import asyncio
import json

import httpx
import pytest

from tandem.loadgen.replicas import (
    GatewayMetricsSource,
    RegistrySource,
    ReplicaPoller,
    count_roles,
    metrics_url,
    roles_from_metrics,
)
from tandem.registry_entry import EngineInfo


def entry(engine_id, model="tiny", role="normal", draining=False):
    info = EngineInfo(engine_id, model, role, "127.0.0.1:1", draining=draining)
    return json.dumps(info.to_fields()).encode()


def test_roles_are_counted_for_the_model_only():
    entries = [
        entry("p1", role="prompt"),
        entry("c1", role="completion"),
        entry("c2", role="completion"),
        entry("c3", role="completion", draining=True),  # takes no new work
        entry("x1", model="other", role="completion"),
        None,  # expired between SMEMBERS and MGET
        b"not json",
        json.dumps({"v": "999", "kind": "engine", "data": "{}"}),  # another protocol version
    ]
    assert count_roles(entries, "tiny") == {"prompt": 1, "completion": 2}
    assert count_roles(entries, "absent") == {}


METRICS = """# HELP tandem_gateway_engines Live engines.
# TYPE tandem_gateway_engines gauge
tandem_gateway_engines{model="tiny",role="normal"} 0.0
tandem_gateway_engines{model="tiny",role="prompt"} 2.0
tandem_gateway_engines{model="tiny",role="completion"} 3.0
tandem_gateway_engines{model="other",role="normal"} 4.0
"""


def test_roles_from_a_gateways_metrics():
    assert roles_from_metrics(METRICS, "tiny") == {"prompt": 2, "completion": 3}
    assert roles_from_metrics(METRICS, "absent") == {}  # a Tandem gateway; no such model
    assert roles_from_metrics("# HELP x y\n# TYPE x counter\nx_total 1\n", "tiny") is None


def test_the_metrics_url_sits_beside_the_api():
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert metrics_url("https://h/tandem/v1") == "https://h/tandem/metrics"


@pytest.mark.asyncio
async def test_registry_source_reads_the_registry(redis_url, keys, redis_client):
    redis_client.set(keys.engine_key("p1"), entry("p1", role="prompt"))
    redis_client.sadd(keys.engines_set, "p1", "gone")
    source = RegistrySource(redis_url, keys.prefix, "tiny")
    try:
        assert await source() == {"prompt": 1}
    finally:
        await source.close()


def test_the_poll_interval_must_be_positive():
    source = GatewayMetricsSource("http://127.0.0.1:1/metrics", "tiny", {})
    with pytest.raises(ValueError, match="replica-poll-s"):
        ReplicaPoller(source, interval_s=0)


def test_a_server_without_metrics_is_not_a_tandem_gateway():
    # Its 404 was said in httpx's words, a paragraph with a link to MDN.
    transport = httpx.MockTransport(lambda request: httpx.Response(404, text="Not Found"))

    async def read() -> None:
        source = GatewayMetricsSource("http://other/metrics", "tiny", {}, transport=transport)
        try:
            await source()
        finally:
            await source.close()

    with pytest.raises(LookupError, match=r"^http://other/metrics answers 404: not a Tandem"):
        asyncio.run(read())
