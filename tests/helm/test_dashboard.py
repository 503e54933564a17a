"""The Grafana dashboard reads only metrics that exist, and the chart ships it when asked."""

from __future__ import annotations

import json
from typing import Any

from support.helm import CHART, named, of_kind
from support.metric_names import KUBE_STATE_METRICS, exported_series, metric_names

DASHBOARD = CHART / "dashboards" / "tandem.json"


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    variables = dashboard["templating"]["list"]
    queries += [v["query"]["query"] for v in variables if isinstance(v.get("query"), dict)]
    return queries


def test_every_metric_the_dashboard_reads_exists():
    known = exported_series() | KUBE_STATE_METRICS
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in _expressions(dashboard) for name in metric_names(expr)}
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
