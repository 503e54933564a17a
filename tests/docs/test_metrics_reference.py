"""The metrics tables in the docs name exactly what the engine and the gateway export:
dashboards and alerts are written from them."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from tandem.engine.service.metrics import EngineMetrics
from tandem.gateway.metrics import GatewayMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs"
# A table row naming a metric: | `tandem_engine_steps_total{kind}` ★ | counter | ...
ROW = re.compile(r"^\| `(tandem_[a-z_]+)(?:\{[^}]*\})?`[^|]*\| (counter|gauge|histogram) \|", re.M)


def documented(page: str, prefix: str) -> dict[str, str]:
    rows = ROW.findall((DOCS / page).read_text())
    return {name: kind for name, kind in rows if name.startswith(prefix)}


def exported(registry: CollectorRegistry) -> dict[str, str]:
    """Names as a scrape shows them (a counter's with _total), and their types."""
    names = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        names[name] = family.type
    return names


def test_the_engine_metrics_table_is_what_an_engine_exports():
    assert documented("metrics.md", "tandem_engine_") == exported(
        EngineMetrics("m", "normal").registry
    )


def test_the_gateway_metrics_table_is_what_the_gateway_exports():
    assert documented("gateway.md", "tandem_gateway_") == exported(GatewayMetrics().registry)
