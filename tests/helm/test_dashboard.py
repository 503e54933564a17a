"""The Grafana dashboard reads only metrics that exist, and the chart ships it when asked."""

from __future__ import annotations

import json
import re
from typing import Any

from prometheus_client import CollectorRegistry
from support.helm import CHART, ROOT, named, of_kind

from tandem.gateway.metrics import GatewayMetrics

DASHBOARD = CHART / "dashboards" / "tandem.json"
# kube-state-metrics: the Deployments' replicas are the autoscaler's decisions.
KUBE_STATE_METRICS = {"kube_deployment_spec_replicas", "kube_deployment_status_replicas_ready"}
# Series names per metric type; the engine's counters are declared with "_total" already.
# An "integral" is a counter computed at each scrape (the waiting tokens' token-seconds).
_SUFFIXES = {
    "counter": ("",),
    "integral": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def _series(registry: CollectorRegistry) -> set[str]:
    """Series of a registry's families (prometheus_client strips a counter's "_total")."""
    suffixes = {**_SUFFIXES, "counter": ("_total",)}
    return {f.name + suffix for f in registry.collect() for suffix in suffixes[f.type]}


def _engine_series() -> set[str]:
    """The engine's series, read from its metrics module's source: importing the module
    loads the engine, torch included (5 s), for a list of names."""
    source = (ROOT / "engine_image" / "engine" / "service" / "metrics.py").read_text()
    found = re.findall(r'\b(gauge|counter|histogram|integral)\(\s*"(tandem_engine_\w+)"', source)
    assert len(found) > 15, "the engine's metric definitions changed shape: update this reader"
    return {name + suffix for kind, name in found for suffix in _SUFFIXES[kind]}


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    variables = dashboard["templating"]["list"]
    queries += [v["query"]["query"] for v in variables if isinstance(v.get("query"), dict)]
    return queries


def test_every_metric_the_dashboard_reads_exists():
    known = _engine_series() | _series(GatewayMetrics().registry)
    known |= KUBE_STATE_METRICS
    dashboard = json.loads(DASHBOARD.read_text())
    used = {
        name
        for expr in _expressions(dashboard)
        for name in re.findall(r"\b((?:tandem|kube)_[a-z_]+)\b", expr)
    }
    assert used, "no metric found in the dashboard"
    assert used - known == set(), "the dashboard reads metrics nobody exports"
    assert {"tandem_engine_kv_cache_usage", "tandem_gateway_requests_total"} <= used


def test_the_dashboard_covers_gateway_engines_and_autoscaler():
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Gateway", "Engines", "Autoscaler"]
    assert dashboard["uid"] == "tandem-overview"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_monitoring_ships_the_dashboard_in_a_configmap(renders):
    configmap = named(renders["monitoring-values"], "ConfigMap", "tandem-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["tandem.json"]) == json.loads(DASHBOARD.read_text())
    assert of_kind(renders["defaults-values"], "ConfigMap") == [], "monitoring off: none"
