"""Statistics, goodput and errors from hand-built records; the JSON report against its schema."""

import dataclasses
import json

import jsonschema
import pytest

from tandem.loadgen.record import RequestRecord
from tandem.loadgen.replicas import ReplicaSample
from tandem.loadgen.report import Slo, build_report, format_report, percentile, summarize
from tandem.loadgen.runner import RunResult
from tandem.loadgen.schema import REPORT_SCHEMA


def ok(index, start, ttft, e2e, tokens, chunks=None, prompt_tokens=None):
    """A successful record; chunk times default to evenly spread after the first token."""
    if chunks is None:
        step = (e2e - ttft) / max(1, tokens - 1)
        chunks = [start + ttft + i * step for i in range(tokens)]
    return RequestRecord(
        index=index,
        scheduled_s=start,
        start_s=start,
        input_tokens=10,
        max_tokens=tokens,
        status=200,
        prompt_tokens=prompt_tokens,
        output_tokens=tokens,
        usage_reported=True,
        ttft_s=ttft,
        e2e_s=e2e,
        chunk_times_s=chunks,
        finish_reason="length",
    )


def failed(index, start, status, kind, message, e2e=0.01):
    return RequestRecord(
        index=index,
        scheduled_s=start,
        start_s=start,
        input_tokens=10,
        max_tokens=5,
        status=status,
        e2e_s=e2e,
        error_kind=kind,
        error_message=message,
    )


def records():
    return [
        # TTFT 0.1 s, TPOT (1.1 - 0.1) / 10 = 0.1 s.
        ok(0, 0.0, 0.1, 1.1, 11),
        # TTFT 0.3 s, TPOT (0.7 - 0.3) / 4 = 0.1 s.
        ok(1, 0.5, 0.3, 0.7, 5, prompt_tokens=12),
        # TTFT 0.05 s, TPOT (3.05 - 0.05) / 10 = 0.3 s; ends at 4.0 s.
        ok(2, 0.95, 0.05, 3.05, 11),
        # One token: no TPOT.
        ok(3, 1.0, 0.2, 0.2, 1),
        failed(4, 1.5, 429, "http_429", "queue full"),
        failed(5, 1.6, 429, "http_429", "queue full again"),
        failed(6, 1.7, None, "timeout", "no complete answer within 5 s", e2e=5.0),
    ]


def result(recs=None, replicas=()):
    recs = records() if recs is None else recs
    ends = [r.end_s for r in recs]
    return RunResult(recs, max(ends) - min(r.start_s for r in recs), 1.0e9, list(replicas))


def test_percentiles_interpolate_linearly():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted 1..4: rank (n - 1) q / 100
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_scales_and_handles_no_values():
    s = summarize([0.001, 0.002, 0.003], scale=1000)
    assert (s.count, s.mean, s.p50, s.min, s.max) == (3, pytest.approx(2.0), 2.0, 1.0, 3.0)
    assert summarize([]) is None


def test_tpot_is_time_after_the_first_token_per_further_token():
    recs = records()
    assert recs[0].tpot_s == pytest.approx(0.1)
    assert recs[2].tpot_s == pytest.approx(0.3)
    assert recs[3].tpot_s is None  # one token
    assert recs[4].tpot_s is None  # failed


def test_report_counts_throughput_and_latencies_of_successes_only():
    report = build_report(result(), Slo(), {})
    # Wall: first send (0.0) to last end (timeout: 1.7 + 5.0).
    assert report["wall_s"] == pytest.approx(6.7)
    req = report["requests"]
    assert (req["sent"], req["ok"], req["failed"]) == (7, 4, 3)
    assert req["by_status"] == {"200": 4, "429": 2, "none": 1}
    assert req["errors"] == {
        "http_429": {"count": 2, "example": "queue full"},
        "timeout": {"count": 1, "example": "no complete answer within 5 s"},
    }
    thr = report["throughput"]
    assert thr["output_tokens"] == 11 + 5 + 11 + 1
    # Input tokens: the server's count where it gave one (12), else the requested 10.
    assert thr["input_tokens"] == 10 + 12 + 10 + 10
    assert thr["requests_per_s"] == pytest.approx(4 / 6.7)
    assert thr["output_tokens_per_s"] == pytest.approx(28 / 6.7)
    lat = report["latency_ms"]
    assert lat["ttft"]["count"] == 4
    assert lat["ttft"]["mean"] == pytest.approx((100 + 300 + 50 + 200) / 4)
    assert lat["ttft"]["p50"] == pytest.approx(150.0)
    assert lat["tpot"]["count"] == 3
    assert lat["tpot"]["max"] == pytest.approx(300.0)
    assert lat["e2e"]["max"] == pytest.approx(3050.0)  # the 5 s timeout is not a latency
    assert lat["itl"]["count"] == 10 + 4 + 10


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        (Slo(), 4),  # no SLO: every success
        (Slo(ttft_ms=150), 2),  # TTFT 100 and 50
        (Slo(tpot_ms=150), 3),  # TPOT 100, 100, and the one-token request
        (Slo(ttft_ms=150, tpot_ms=150), 1),  # only request 0 meets both
        (Slo(ttft_ms=10), 0),
    ],
)
def test_goodput_counts_successes_that_met_every_given_slo(slo, good):
    report = build_report(result(), slo, {})
    assert report["goodput"]["good"] == good
    assert report["goodput"]["fraction"] == pytest.approx(good / 7)
    assert report["goodput"]["requests_per_s"] == pytest.approx(good / 6.7)


def test_an_answer_with_no_token_is_good_without_a_ttft_objective():
    # A 200 whose first token was its end (no TTFT): counted ok, it was left out of
    # goodput with no SLO given, where goodput is the success rate.
    empty = RequestRecord(
        index=7, scheduled_s=2.0, start_s=2.0, input_tokens=10, max_tokens=5, status=200,
        prompt_tokens=10, output_tokens=0, usage_reported=True, e2e_s=0.1,
        chunk_times_s=[], finish_reason="stop",
    )  # fmt: skip
    assert empty.ok and empty.ttft_s is None
    assert Slo().met_by(empty) and Slo(tpot_ms=10).met_by(empty)
    assert not Slo(ttft_ms=1000).met_by(empty)


def test_slos_must_be_positive():
    with pytest.raises(ValueError, match="--slo-tpot-ms"):
        Slo(tpot_ms=0)


def test_the_json_report_follows_its_schema():
    replicas = [ReplicaSample(0.0, {"prompt": 1, "completion": 2})]
    report = build_report(result(replicas=replicas), Slo(ttft_ms=100), {"model": "m"})
    # Through JSON and back, as a consumer reads it.
    jsonschema.validate(json.loads(json.dumps(report)), REPORT_SCHEMA)
    assert [r["index"] for r in report["records"]] == list(range(7))
    # And the schema is not vacuous: a report without latencies or with a wrong count fails.
    broken = json.loads(json.dumps(report))
    del broken["latency_ms"]["ttft"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, REPORT_SCHEMA)
    broken = json.loads(json.dumps(report))
    broken["requests"]["ok"] = "4"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, REPORT_SCHEMA)


def test_a_run_with_no_success_still_reports():
    report = build_report(result([failed(0, 0.0, 503, "http_503", "down")]), Slo(), {})
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["latency_ms"]["ttft"] is None
    assert "http_503 x1: down" in format_report(report)


def test_the_text_report_shows_every_section():
    replicas = [ReplicaSample(0.0, {"normal": 1}), ReplicaSample(1.0, {"normal": 2})]
    text = format_report(build_report(result(replicas=replicas), Slo(ttft_ms=150), {}))
    assert "7 sent, 4 ok, 3 failed" in text
    assert "HTTP status 200: 4, 429: 2, none: 1" in text
    assert "TTFT" in text and "TPOT" in text and "E2E" in text
    assert "(2/7 met TTFT <= 150 ms)" in text
    assert "timeout x1" in text
    assert "replicas     normal 1..2" in text


def test_sends_that_waited_for_a_slot_and_requests_cut_are_said():
    # Sends late for want of a --concurrency slot measure from the send: the rate asked
    # was not offered, and the report said nothing. Requests cut by a Ctrl-C (the slow
    # ones) vanished from "sent" and from the goodput fraction's denominator.
    recs = records()
    recs[1] = dataclasses.replace(recs[1], scheduled_s=0.1)  # sent 0.4 s after its arrival
    cut = RunResult(recs, 6.7, 1.0e9, interrupted=3, left_unsent=True)
    report = build_report(cut, Slo(), {"concurrency": 2})
    req = report["requests"]
    assert (req["sent"], req["ok"], req["failed"], req["interrupted"]) == (10, 4, 3, 3)
    assert (req["late"], req["left_unsent"]) == (1, True)
    assert req["slot_wait_max_s"] == pytest.approx(0.4)
    assert report["goodput"]["fraction"] == pytest.approx(4 / 10)
    jsonschema.validate(json.loads(json.dumps(report)), REPORT_SCHEMA)
    text = format_report(report)
    assert "offered load not met: 1 sends waited for a free --concurrency slot" in text
    assert "(up to 0.40 s; latencies count from the send)" in text
    assert "arrivals within --duration were left unsent" in text
    assert "the 3 requests in flight were cut (counted sent, not ok)" in text
    quiet = format_report(build_report(result(), Slo(), {}))
    assert "offered load" not in quiet
    # No cap: the sends were late on the client itself, not for a slot.
    uncapped = format_report(build_report(cut, Slo(), {"concurrency": None}))
    assert "1 sends waited on this client, which could not keep up" in uncapped


def test_a_closed_loop_misses_no_offered_load():
    # --rate inf (every arrival at 0): each send after the first --concurrency ones
    # "waited", and every default run said the offered load was not met.
    recs = [dataclasses.replace(r, scheduled_s=0.0) for r in records()]
    closed = RunResult(recs, 6.7, 1.0e9, left_unsent=True, closed_loop=True)
    report = build_report(closed, Slo(), {"concurrency": 2})
    req = report["requests"]
    assert (req["late"], req["slot_wait_max_s"], req["left_unsent"]) == (0, 0.0, False)
    assert "offered load" not in format_report(report)
