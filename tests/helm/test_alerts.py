"""The chart's alerting rules: valid for Prometheus, reading metrics that exist, and
firing when (and only when) what they name happens, as promtool evaluates them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from support.helm import NAMESPACE, of_kind, render
from support.metric_names import exported_series, metric_names
from support.promtool import promtool_path, run_promtool

# The series as the monitoring-values render scrapes them: the gateway's through its
# ServiceMonitor (job = the Service), the engines' through the PodMonitor (job =
# namespace/name), in the served namespace "models".
GATEWAY = f'job="tandem-gateway", namespace="{NAMESPACE}"'
ENGINES = f'job="{NAMESPACE}/tandem-engines", namespace="models"'
OTHER_RELEASE = f'job="other-gateway", namespace="{NAMESPACE}"'


@pytest.fixture(scope="module")
def promtool() -> str:
    return promtool_path()


@pytest.fixture(scope="module")
def rule_groups(renders) -> list[dict[str, Any]]:
    [rule] = of_kind(renders["monitoring-values"], "PrometheusRule")
    return rule["spec"]["groups"]


def _alerts(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for g in groups for r in g["rules"]]


def test_the_rules_are_valid_prometheus_rules(promtool, rule_groups, tmp_path):
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups}))
    checked = run_promtool(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout


def test_every_metric_the_rules_read_exists(rule_groups):
    used = {name for rule in _alerts(rule_groups) for name in metric_names(rule["expr"])}
    assert used - exported_series() == set(), "the alerts read metrics nobody exports"


def test_every_alert_says_what_and_where_to_look(rule_groups):
    for rule in _alerts(rule_groups):
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_rules_carry_the_users_labels_and_can_be_left_out(helm):
    extra = ["monitoring.enabled=true", "monitoring.alerts.ruleLabels.team=ml"]
    [rule] = of_kind(render(helm, sets=extra), "PrometheusRule")
    assert {r["labels"]["team"] for r in _alerts(rule["spec"]["groups"])} == {"ml"}
    off = [*extra, "monitoring.alerts.enabled=false"]
    assert of_kind(render(helm, sets=off), "PrometheusRule") == []


def _series(metric: str, scrape: str, **labels: str) -> str:
    """A series in promtool's notation: the metric, its scrape labels, then these."""
    return metric + "{" + ", ".join([scrape, *(f'{k}="{v}"' for k, v in labels.items())]) + "}"


def _gateway(metric: str, **labels: str) -> str:
    return _series(metric, GATEWAY, pod="a", **labels)


def _engine(metric: str, **labels: str) -> str:
    return _series(metric, ENGINES, role="completion", **labels)


def _requests(route: str, model: str, status: str) -> str:
    return _gateway("tandem_gateway_requests_total", route=route, model=model, status=status)


# The gateway is up in every case but its own.
GATEWAY_UP = (_gateway("up"), "1x40")
_KV_FAILED, _KV_FETCHED = (
    "tandem_engine_kv_transfer_failures_total",
    "tandem_engine_kv_transfer_seconds_count",
)
# (the input series, [(minute, alert, the labels of each alert firing then)]). Each case
# has series that must not fire beside those that must.
CASES: dict[str, tuple[list[tuple[str, str]], list[tuple[int, str, list[dict[str, str]]]]]] = {
    "gateway down": (
        [(_gateway("up"), "1x3 0x10"), (_series("up", OTHER_RELEASE, pod="x"), "1x13")],
        [
            (6, "TandemGatewayDown", []),  # down for 3 of the 5 minutes
            (10, "TandemGatewayDown", [{"namespace": NAMESPACE}]),
        ],
    ),
    "gateway without Redis": (
        [
            GATEWAY_UP,
            (_gateway("tandem_gateway_redis_up"), "0x5"),
            (_series("tandem_gateway_redis_up", GATEWAY, pod="b"), "1x5"),
            (_series("tandem_gateway_redis_up", OTHER_RELEASE, pod="x"), "0x5"),
        ],
        [(3, "TandemGatewayRedisUnreachable", [{"namespace": NAMESPACE, "pod": "a"}])],
    ),
    "API keys stale": (
        [
            GATEWAY_UP,
            # Pod a could not read the key file's last change for 8 minutes; pod b for 3.
            (_gateway("tandem_gateway_api_keys_stale"), "1x8 0x4"),
            (_series("tandem_gateway_api_keys_stale", GATEWAY, pod="b"), "0x2 1x3 0x7"),
            (_series("tandem_gateway_api_keys_stale", OTHER_RELEASE, pod="x"), "1x12"),
        ],
        [
            (7, "TandemGatewayAPIKeysStale", [{"namespace": NAMESPACE, "pod": "a"}]),
            (11, "TandemGatewayAPIKeysStale", []),  # read again
        ],
    ),
    "requests failing": (
        [
            GATEWAY_UP,
            # Model m: 10 % of its completions 503; model n: 1 %; 429s are not failures.
            (_requests("/v1/chat/completions", "m", "200"), "0+90x30"),
            (_requests("/v1/chat/completions", "m", "503"), "0+10x30"),
            (_requests("/v1/completions", "n", "200"), "0+99x30"),
            (_requests("/v1/completions", "n", "504"), "0+1x30"),
            (_requests("/v1/completions", "n", "429"), "0+500x30"),
            (_requests("/metrics", "unknown", "503"), "0+100x30"),
        ],
        [(20, "TandemRequestsFailing", [{"namespace": NAMESPACE, "model": "m"}])],
    ),
    "queue without engines": (
        [
            GATEWAY_UP,
            (_gateway("tandem_gateway_queue_waiting", model="m", priority="normal"), "1x20"),
            (_gateway("tandem_gateway_engines", model="m", role="normal"), "0x20"),
            # Model n waits too, but engines of both roles serve it (it is only busy).
            (_gateway("tandem_gateway_queue_waiting", model="n", priority="normal"), "5x20"),
            (_gateway("tandem_gateway_engines", model="n", role="prompt"), "1x20"),
            (_gateway("tandem_gateway_handoffs_waiting", model="n"), "3x20"),
            (_gateway("tandem_gateway_engines", model="n", role="completion"), "1x20"),
            # Model d lost its prompt role: its decoders never take a request.
            (_gateway("tandem_gateway_queue_waiting", model="d", priority="normal"), "2x20"),
            (_gateway("tandem_gateway_engines", model="d", role="prompt"), "0x20"),
            (_gateway("tandem_gateway_engines", model="d", role="completion"), "2x20"),
            # Model e lost its decoders: its prefilled requests wait for one.
            (_gateway("tandem_gateway_handoffs_waiting", model="e"), "4x20"),
            (_gateway("tandem_gateway_engines", model="e", role="prompt"), "1x20"),
            (_gateway("tandem_gateway_engines", model="e", role="completion"), "0x20"),
            # Model g: a request every 5 minutes, each given up on by its client within
            # one (its entry withdrawn), and no engine ever: the queue empties between.
            (
                _gateway("tandem_gateway_queue_waiting", model="g", priority="normal"),
                " ".join(["1 0 0 0 0"] * 4),
            ),
            (_gateway("tandem_gateway_engines", model="g", role="normal"), "0x20"),
        ],
        [
            (8, "TandemQueueWithoutEngines", []),  # a scale from zero takes minutes
            (
                15,
                "TandemQueueWithoutEngines",
                [{"namespace": NAMESPACE, "model": m} for m in ("m", "d", "e", "g")],
            ),
        ],
    ),
    "KV cache full": (
        [
            GATEWAY_UP,
            (_engine("tandem_engine_kv_cache_usage", pod="d", model="m"), "0.97x20"),
            # Full engines swing around the 90 % watermark: a mean of 0.89 is saturated.
            (_engine("tandem_engine_kv_cache_usage", pod="s", model="s"), "0.97 0.81 " * 10),
            # At the autoscaler's target, or briefly full: no alert.
            (_engine("tandem_engine_kv_cache_usage", pod="t", model="t"), "0.72x20"),
            (_engine("tandem_engine_kv_cache_usage", pod="u", model="u"), "0.5x8 0.99x12"),
            # Prompt engines hold prefilled KV until it is fetched: full is not a problem.
            (_series("tandem_engine_kv_cache_usage", ENGINES, role="prompt", model="n"), "0.99x20"),
        ],
        [
            (
                18,
                "TandemKVCacheSaturated",
                [{"namespace": "models", "model": "m"}, {"namespace": "models", "model": "s"}],
            )
        ],
    ),
    "KV transfers failing": (
        [
            GATEWAY_UP,
            (_engine(_KV_FAILED, pod="d", model="m", reason="unreachable"), "0+20x30"),
            (_engine(_KV_FETCHED, pod="d", model="m"), "0+80x30"),
            (_engine(_KV_FAILED, pod="e", model="n", reason="timeout"), "0+1x30"),
            (_engine(_KV_FETCHED, pod="e", model="n"), "0+99x30"),
        ],
        [(20, "TandemKVTransferFailing", [{"namespace": "models", "model": "m"}])],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_an_alert_fires_on_what_it_names_and_nothing_else(promtool, rule_groups, tmp_path, case):
    series, expected = CASES[case]
    # Annotations left out: promtool compares them whole, and the wording is not the rule.
    groups = copy.deepcopy(rule_groups)
    for rule in _alerts(groups):
        rule.pop("annotations")
    severity = {r["alert"]: r["labels"]["severity"] for r in _alerts(groups)}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    fired = [
        {
            "eval_time": f"{minute}m",
            "alertname": alert,
            "exp_alerts": [
                {"exp_labels": {**labels, "severity": severity[alert]}} for labels in each
            ],
        }
        for minute, alert, each in expected
    ]
    # Every other alert stays silent at the last of those times.
    last = f"{expected[-1][0]}m"
    silent = [{"eval_time": last, "alertname": a, "exp_alerts": []} for a in severity]
    silent = [s for s in silent if s["alertname"] not in {a for _, a, _ in expected}]
    test = {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": fired + silent,
    }
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [test]}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec))
    result = run_promtool(promtool, "test", "rules", "test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cases_cover_every_alert(rule_groups):
    covered = {alert for _, expected in CASES.values() for _, alert, _ in expected}
    assert covered == {r["alert"] for r in _alerts(rule_groups)}
