"""`tandem bench` against `tandem up` (real Redis, gateway and engine processes, random:tiny):
the bench's figures agree with the gateway's own /metrics.

Agreement, and why the tolerance is what it is. Request counts by HTTP status
must be equal. For latencies the gateway's histograms give sums and counts,
so the test compares means over the same requests. Each client interval
contains the gateway's interval for the same request: the client starts its
clock before writing the request and stops after reading and parsing the
chunk, the gateway starts when uvicorn hands it the parsed request and stops
when it hands over the chunk (TTFT) or the last body part (E2E). So the
bench's mean may not be below the gateway's (1 ms of slack for float sums)
and may exceed it only by the client-side overhead: loopback TCP, HTTP and
SSE parsing, and waiting for a core. That is 1-2 ms on an idle machine and
measured 6-7 ms on the 2-core development machine with the engine and other
jobs competing; the bound is 25 ms, several times that, yet well below what
a timing mistake would shift (one token's gap here is 50-150 ms, so a bench
that took TTFT at the wrong chunk or timed from the planned arrival would fail).
"""

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.stacks import running_stack

from tandem import cli
from tandem.redis_server import free_port
from tandem.trace import TraceRequest, write_trace
from tandem.up import UpConfig

pytestmark = pytest.mark.timeout(240)

API_KEY = "sk-bench-test"
MAX_MODEL_LEN = 256
# Mean client-side overhead allowed per request, seconds (see the module docstring).
TOLERANCE_S = 0.025
ROUTE = "/v1/completions"
# Requests whose prompt is longer than the engine's context: the gateway answers 400.
TOO_LONG = {4, 13}


@pytest.fixture
def stack(tmp_path, monkeypatch):
    # The optional C++ kernels compile on first use: not needed to answer.
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    config = UpConfig(
        model="random:tiny",
        served_model_name="tiny",
        port=free_port(),
        api_key=API_KEY,
        log_dir=tmp_path / "up",
        engine_args=("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "128"),
    )
    with running_stack(config) as stack:
        yield stack


def gateway_samples(url):
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(samples, name, **labels):
    return sum(v for n, have, v in samples if n == name and labels.items() <= have.items())


def test_bench_figures_agree_with_the_gateways_metrics(stack, tmp_path):
    trace = [
        TraceRequest(
            arrival_s=0.15 * i,
            input_tokens=MAX_MODEL_LEN + 44 if i in TOO_LONG else 16 + 2 * i,
            output_tokens=8 + i % 9,
        )
        for i in range(20)
    ]
    write_trace(tmp_path / "trace.jsonl", trace)
    report_path, plots = tmp_path / "report.json", tmp_path / "plots"
    argv = [
        "bench", "--url", stack.url, "--api-key", API_KEY, "--model", "tiny",
        "--trace", str(tmp_path / "trace.jsonl"), "--concurrency", "8",
        "--json", str(report_path), "--plots", str(plots),
        "--replica-poll-s", "0.5", "--quiet",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads(report_path.read_text())
    records = report["records"]
    samples = gateway_samples(stack.url)

    # Counts by status: the bench's equal the gateway's.
    assert report["requests"]["by_status"] == {"200": 18, "400": 2}
    gateway_status = {
        labels["status"]: int(value)
        for name, labels, value in samples
        if name == "tandem_gateway_requests_total" and labels["route"] == ROUTE
    }
    assert gateway_status == report["requests"]["by_status"]
    assert report["requests"]["errors"]["http_400"]["count"] == 2
    assert {r["index"] for r in records if r["status"] == 400} == TOO_LONG

    # Token ids prompts are exact, and ignore_eos makes every output max_tokens long.
    ok = [r for r in records if r["error_kind"] is None]
    assert all(r["prompt_tokens"] == r["input_tokens"] for r in ok)
    assert all(r["output_tokens"] == r["max_tokens"] and r["usage_reported"] for r in ok)
    assert report["throughput"]["output_tokens"] == sum(
        t.output_tokens for i, t in enumerate(trace) if i not in TOO_LONG
    )

    # TTFT: the 18 streams with tokens, on both sides.
    ttft = "tandem_gateway_time_to_first_token_seconds"
    assert total(samples, f"{ttft}_count") == len(ok) == report["latency_ms"]["ttft"]["count"]
    gateway_mean = total(samples, f"{ttft}_sum") / len(ok)
    bench_mean = sum(r["ttft_s"] for r in ok) / len(ok)
    assert -0.001 <= bench_mean - gateway_mean <= TOLERANCE_S, (bench_mean, gateway_mean)

    # End to end: the 18 answered requests (the gateway times no refusal).
    e2e = "tandem_gateway_request_seconds"
    assert total(samples, f"{e2e}_count", route=ROUTE) == len(ok) == 18
    gateway_mean = total(samples, f"{e2e}_sum", route=ROUTE) / len(ok)
    bench_mean = sum(r["e2e_s"] for r in ok) / len(ok)
    assert -0.001 <= bench_mean - gateway_mean <= TOLERANCE_S, (bench_mean, gateway_mean)

    # Replicas per role, from the gateway's /metrics: one NORMAL engine throughout.
    assert report["replicas"] and all(s["roles"] == {"normal": 1} for s in report["replicas"])
    for name in ("latency_cdfs.png", "throughput.png", "replicas.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
