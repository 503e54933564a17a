"""A model scaled to zero: declared in the catalog, its requests wait in the queue.

The operator (and `tandem up -f`) declares every model it runs (tandem/catalog.py);
the gateway must queue requests for a declared model with no engine, so that the
autoscaler sees work and starts one, instead of answering 404.
"""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.polling import eventually

from tandem import catalog
from tandem.protocol import PRIORITY_NORMAL

MODEL = "tiny"  # what the test engines serve


def _scraped(gateway, name: str, **labels: str) -> float:
    """One sample of model MODEL as a scrape of /metrics reads it."""
    with gateway.http() as http:
        text = http.get("/metrics").text
    [value] = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.labels == {"model": MODEL, **labels}
    ]
    return value


def _engines_scraped(gateway) -> float:
    return _scraped(gateway, "tandem_gateway_engines", role="normal")


def _backlog_scraped(gateway) -> tuple[float, float]:
    """The waiting work items (normal priority) and their estimated prompt tokens."""
    waiting = _scraped(gateway, "tandem_gateway_queue_waiting", priority="normal")
    return waiting, _scraped(gateway, "tandem_gateway_queue_prompt_tokens")


def test_a_request_for_a_declared_model_waits_for_its_first_engine(
    start_gateway, engines, redis_client, keys
):
    gateway = start_gateway(models_cache_s=0.0)  # no cached list to wait out
    with gateway.http() as http:
        assert http.get("/v1/models").json()["data"] == []
        catalog.declare(redis_client, keys, MODEL, "test/tiny", ttl_s=60)
        before = time.time()
        [card] = http.get("/v1/models").json()["data"]
        # No engine yet to date it by: the listing's time, not 0 (read as 1970).
        assert card["id"] == MODEL and int(before) <= card["created"] <= time.time()

    answers = []
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}

    def ask() -> None:
        with gateway.http() as client:  # 60 s: an engine starts in a few
            answers.append(client.post("/v1/completions", json=body))

    asker = threading.Thread(target=ask)
    asker.start()
    # Queued, not refused: the work the autoscaler scales from zero on.
    stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
    assert eventually(lambda: redis_client.xlen(stream) == 1)
    assert _engines_scraped(gateway) == 0
    # What an alert on a stuck queue reads (the request, "hello": 2 estimated tokens).
    assert _backlog_scraped(gateway) == (1, 2)
    engines("normal")  # what the autoscaler would start
    asker.join(timeout=90)
    [answer] = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 3
    assert _engines_scraped(gateway) == 1
    assert _backlog_scraped(gateway) == (0, 0)


def test_an_undeclared_or_lapsed_model_is_unknown(start_gateway, redis_client, keys):
    gateway = start_gateway(models_cache_s=0.0)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    with gateway.http() as http:
        refused = http.post("/v1/completions", json=body)
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "model_not_found"
        catalog.declare(redis_client, keys, MODEL, "test/tiny", ttl_s=0.5)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
        time.sleep(0.6)  # the declaration lapses: a deleted ModelDeployment's fate
        assert http.get("/v1/models").json()["data"] == []
        assert http.post("/v1/completions", json=body).status_code == 404
    assert redis_client.smembers(keys.models_set) == set()  # pruned by the reader


def test_requests_left_queued_by_a_lapsed_declaration_stay_in_the_gauges(
    start_gateway, redis_client, keys
):
    # The operator down: its declaration lapses with requests queued and no engine. The
    # gauges read 0, and the alert on work without engines went silent.
    gateway = start_gateway(models_cache_s=0.0)
    catalog.declare(redis_client, keys, MODEL, "test/tiny", ttl_s=1.0)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}

    def ask() -> None:
        with gateway.http() as client:
            client.post("/v1/completions", json=body, headers={"X-Tandem-Timeout": "5"})

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        stream = keys.work_stream(MODEL, PRIORITY_NORMAL)
        assert eventually(lambda: redis_client.xlen(stream) == 1)
        assert _backlog_scraped(gateway)[0] == 1
        time.sleep(1.2)  # lapsed: no longer served
        with gateway.http() as http:
            assert http.get("/v1/models").json()["data"] == []
        assert _backlog_scraped(gateway)[0] == 1 and _engines_scraped(gateway) == 0
    finally:
        asker.join(timeout=10)


def test_a_declaration_needs_a_positive_ttl(redis_client, keys):
    with pytest.raises(ValueError, match="positive TTL"):
        catalog.declare(redis_client, keys, MODEL, "x", ttl_s=0)
