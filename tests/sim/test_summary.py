"""What a run reports: rates over the run's span, tokens as generated, failures with reasons."""

import json

import pytest

from tandem.sim import deployment as deploy
from tandem.sim.cluster import ClusterConfig, simulate
from tandem.sim.devices import H200
from tandem.sim.model_shapes import model_shape
from tandem.sim.report import document, text
from tandem.sim.summary import SLO, summarize
from tandem.trace import TraceRequest

LLAMA_8B = model_shape("llama-8b")


def _summary(requests, deployment=None, **kwargs):
    config = ClusterConfig(deployment or deploy.normal(1), H200, LLAMA_8B, **kwargs)
    result = simulate(config, requests)
    return result, summarize(result, SLO())


def test_requests_arriving_together_have_a_finite_rate():
    # All at one instant: the old denominator (first to last arrival, floored at
    # 1e-9 s) made this 3e9 req/s. The run's span ends at the last answer.
    result, summary = _summary([TraceRequest(2.0, 100, 20)] * 3)
    last = max(r.finish_s for r in result.records)
    assert summary.duration_s == pytest.approx(last)
    assert summary.throughput_rps == pytest.approx(3 / last)
    assert summary.goodput_rps == pytest.approx(3 / last)


def test_the_span_counts_from_the_start_not_from_the_first_arrival():
    # Ten requests a second apart, from t = 1: 1 req/s offered; the span from the
    # first arrival (9 s and a bit) would read more than that.
    requests = [TraceRequest(1.0 + i, 100, 10) for i in range(10)]
    result, summary = _summary(requests)
    assert summary.duration_s == pytest.approx(result.records[-1].finish_s)
    assert summary.throughput_rps < 1.0


def test_an_unfinished_run_counts_to_where_it_stopped():
    _, summary = _summary([TraceRequest(0.0, 100, 5000)], max_time_s=3.0)
    assert summary.unfinished == 1 and summary.duration_s == 3.0
    assert summary.throughput_rps == 0.0


def test_requests_after_the_run_stopped_are_not_counted_as_unfinished():
    # Stopped at 3 s, a run never saw the request arriving at 10 s: counted as
    # unfinished (and as an SLO miss), it halved a run stopped halfway.
    requests = [TraceRequest(0.0, 100, 5000), TraceRequest(10.0, 100, 5)]
    _, summary = _summary(requests, max_time_s=3.0)
    assert (summary.requests, summary.unfinished) == (1, 1)


def test_an_output_cut_at_max_model_len_counts_what_it_generated():
    # 100 + 1000 tokens do not fit a 512-token context: the scheduler stops the
    # request at 412 output tokens, and TPOT and tokens/s count those.
    result, summary = _summary(
        [TraceRequest(0.0, 100, 1000)], deploy.normal(1, engine={"max_model_len": 512})
    )
    rec = result.records[0]
    assert rec.generated_tokens == 412 == result.tokens
    assert rec.tpot_s == pytest.approx((rec.finish_s - rec.first_token_s) / 411)
    assert summary.truncated == 1
    assert summary.output_tokens_per_s * summary.duration_s == pytest.approx(412)
    assert "cut short 1: their context reached max_model_len" in text(summary, result)


def test_failures_are_counted_by_reason_in_text_and_json():
    # 1e11 prompt tokens: refused before a prompt that size is allocated (it was a MemoryError).
    requests = [TraceRequest(0.0, 100, 10), TraceRequest(0.1, 9000, 10)]
    requests.append(TraceRequest(0.2, 100_000_000_000, 10))
    result, summary = _summary(requests)
    reason = "prompt over 8191 tokens, the engines' limit (max_model_len 8192 less one)"
    assert summary.failed == 2 and summary.failures == {reason: 2}
    assert f"  failed    2: {reason}" in text(summary, result).splitlines()
    doc = json.loads(json.dumps(document(summary, result, {})))
    assert doc["summary"]["failures"] == {reason: 2}
