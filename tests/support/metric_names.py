"""The series Tandem exports, for the tests of what reads them (dashboard, alerts)."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry

from support.helm import ROOT
from tandem.gateway.metrics import GatewayMetrics

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


def exported_series() -> set[str]:
    """Every series name the gateway and the engines export."""
    return _engine_series() | _series(GatewayMetrics().registry)


def metric_names(expr: str) -> set[str]:
    """The Tandem and kube-state-metrics series a PromQL expression reads."""
    return set(re.findall(r"\b((?:tandem|kube)_[a-z_]+)\b", expr))


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
