"""The chart speaks the code's language: flags the CLI accepts, labels and ports the operator uses.

The images run the same `tandem` CLI the tests run, so the rendered command
lines and environments are fed to that CLI's own parsers and settings; the
engine selectors and ports are checked against operator/manifests*.py.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.helm import CHART, NAMESPACE, named, of_kind, render

from tandem.cli import build_parser
from tandem.gateway.settings import GatewaySettings
from tandem.operator import crd
from tandem.operator.engine_flags import HTTP_PORT, KV_PORT
from tandem.operator.manifests import labels
from tandem.operator.manifests_pods import container_ports
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import RoleSpec
from tandem.operator.settings import OperatorSettings, env_name, from_args

REDIS_PASSWORD = "s3cret"


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as Kubernetes would set it (Secrets: test values)."""
    env: dict[str, str] = {}
    for item in container["env"]:
        value = item.get("value")
        if value is None:
            ref = item["valueFrom"]
            key = (ref.get("secretKeyRef") or {}).get("key")
            value = {"password": REDIS_PASSWORD, "url": "redis://team-redis:6379/0"}.get(
                key, "from-" + str(key)
            )
        env[item["name"]] = value.replace("$(REDIS_PASSWORD)", env.get("REDIS_PASSWORD", ""))
    return env


@pytest.mark.parametrize("name", ["defaults-values", "namespace-scoped-values"])
def test_the_operator_settings_come_out_of_its_environment(renders, name):
    container = _container(named(renders[name], "Deployment", "tandem-operator"))
    env = _env(container)
    known = {env_name(field) for field in OperatorSettings.__dataclass_fields__}
    assert {k for k in env if k.startswith("TANDEM_OPERATOR_")} <= known, "unknown variables"
    settings = from_args(build_parser().parse_args(["operator"]), env)
    assert settings.redis_url == f"redis://:{REDIS_PASSWORD}@tandem-redis.{NAMESPACE}.svc:6379/0"
    assert settings.engine_image == "ghcr.io/tandem-serving/engine:0.1.0"
    assert settings.clusterwide is (name == "defaults-values")
    assert not settings.standalone and settings.liveness_endpoint.endswith(":8080/healthz")


@pytest.mark.parametrize(
    ("name", "sets", "names"),
    [
        ("placement-values", [], ("regcred", "mirror-pull")),  # both forms values take
        ("defaults-values", ["imagePullSecrets[0].name=regcred"], ("regcred",)),
        ("defaults-values", ["imagePullSecrets={a,b,a}"], ("a", "b")),
        ("defaults-values", [], ()),
    ],
)
def test_the_chart_pull_secrets_are_the_engine_pods_default(helm, name, sets, names):
    values = [CHART / "ci" / f"{name}.yaml"]
    manifests = render(helm, values=values, sets=sets)
    env = _env(_container(named(manifests, "Deployment", "tandem-operator")))
    assert ("TANDEM_OPERATOR_ENGINE_IMAGE_PULL_SECRETS" in env) is bool(names)
    settings = from_args(build_parser().parse_args(["operator"]), env)
    assert settings.engine_image_pull_secrets == names


def test_each_operator_pod_gets_its_own_priority(renders, tmp_path: Path):
    """The command's shell derives the peering priority from the pod's name, then runs tandem."""
    container = _container(named(renders["defaults-values"], "Deployment", "tandem-operator"))
    fake = tmp_path / "tandem"
    fake.write_text('#!/bin/sh\necho "$TANDEM_OPERATOR_PRIORITY $*"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    # Kubernetes turns $$ into $ in command and args.
    command = [part.replace("$$", "$") for part in container["command"]]
    priorities = set()
    for pod in ("tandem-operator-7d9f8b6c5d-abcde", "tandem-operator-7d9f8b6c5d-vwxyz"):
        env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "POD_NAME": pod}
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        priority, args = out.stdout.split(" ", 1)
        assert args.strip() == "operator"
        priorities.add(int(priority))
    assert len(priorities) == 2, "two pods, two priorities (kopf pauses equal ones)"


@pytest.mark.parametrize(
    "name", ["defaults-values", "namespace-scoped-values", "external-redis-values"]
)
def test_the_gateway_accepts_its_command_line(renders, name):
    container = _container(named(renders[name], "Deployment", "tandem-gateway"))
    assert container["command"] == ["tandem", "gateway"]
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    settings = GatewaySettings.from_args(args)
    assert settings.port == container["ports"][0]["containerPort"]
    env = _env(container)
    assert env["TANDEM_REDIS_URL"].startswith("redis://")
    keys_file = settings.api_keys_file
    if name == "namespace-scoped-values":
        assert keys_file == "/etc/tandem/keys/keys.json" and "TANDEM_API_KEYS" not in env
    else:
        assert keys_file is None and "TANDEM_API_KEYS" in env, "the bootstrap key"


def test_the_gateways_allowed_origins_reach_its_settings(helm):
    sets = ["gateway.allowedOrigins={https://chat.example.com,http://localhost:3000}"]
    container = _container(named(render(helm, sets=sets), "Deployment", "tandem-gateway"))
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    origins = ("https://chat.example.com", "http://localhost:3000")
    assert GatewaySettings.from_args(args).allowed_origins == origins


@pytest.mark.parametrize(
    ("sets", "bootstrap"),
    [
        ([], True),
        (["gateway.auth.keys[0].name=a", "gateway.auth.keys[0].key=sk-a"], False),
        (["gateway.auth.existingSecret=tenant-keys"], False),
        (["gateway.auth.existingSecret=tenant-keys", "gateway.auth.bootstrapKey=true"], True),
    ],
)
def test_keys_of_ones_own_retire_the_bootstrap_key(helm, sets, bootstrap):
    # The bootstrap key may use every model without quotas: beside keys with limits it
    # would be a way around them that nobody asked for.
    manifests = render(helm, sets=sets)
    env = _env(_container(named(manifests, "Deployment", "tandem-gateway")))
    secrets = [s["metadata"]["name"] for s in of_kind(manifests, "Secret")]
    assert ("TANDEM_API_KEYS" in env) is bootstrap
    assert ("tandem-gateway-bootstrap-key" in secrets) is bootstrap


@pytest.mark.parametrize("seconds", [0, 5, 20])
def test_a_stopping_gateway_takes_connections_until_its_service_forgets_it(helm, seconds):
    sets = [f"gateway.preStopSeconds={seconds}", "gateway.shutdownTimeout=30"]
    deployment = named(render(helm, sets=sets), "Deployment", "tandem-gateway")
    pod, container = deployment["spec"]["template"], _container(deployment)
    if seconds:
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(seconds)]
    else:
        assert "lifecycle" not in container
    # The sleep and the drain both fit the grace period, with 10 s to spare.
    assert pod["spec"]["terminationGracePeriodSeconds"] == seconds + 30 + 10


def test_images_are_pulled_by_digest_where_one_is_given(helm):
    digest = f"sha256:{'0123456789abcdef' * 4}"
    sets = [f"{image}.digest={digest}" for image in ("gateway.image", "operator.engineImage")]
    manifests = render(helm, sets=[*sets, "gateway.image.tag=9.9.9"])
    gateway = _container(named(manifests, "Deployment", "tandem-gateway"))
    operator = _container(named(manifests, "Deployment", "tandem-operator"))
    assert gateway["image"] == f"ghcr.io/tandem-serving/gateway@{digest}"  # the tag ignored
    assert (
        _env(operator)["TANDEM_OPERATOR_ENGINE_IMAGE"] == f"ghcr.io/tandem-serving/engine@{digest}"
    )
    assert "@" not in operator["image"]  # the others by tag, as before


def test_the_gateway_without_auth_runs_open(helm):
    manifests = render(helm, sets=["gateway.auth.enabled=false"])
    container = _container(named(manifests, "Deployment", "tandem-gateway"))
    args = build_parser().parse_args(["gateway", *container["args"]])
    assert GatewaySettings.from_args(args).no_auth
    assert not [s for s in of_kind(manifests, "Secret") if "gateway" in s["metadata"]["name"]]


def _engine_selectors(manifests: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Every selector meant to pick engine pods: the engines' policy, its KV peers, the
    engine peer of Redis' policy, the PodMonitor."""
    found = []
    for policy in of_kind(manifests, "NetworkPolicy"):
        name, spec = policy["metadata"]["name"], policy["spec"]
        if name.endswith("-engines"):
            found.append(spec["podSelector"]["matchLabels"])
            kv = [r for r in spec["ingress"] if r["ports"][0]["port"] == KV_PORT]
            found += [peer["podSelector"]["matchLabels"] for peer in kv[0]["from"]]
        if name.endswith("-redis"):
            peers = spec["ingress"][0]["from"]
            found += [p["podSelector"]["matchLabels"] for p in peers if "namespaceSelector" in p]
    for monitor in of_kind(manifests, "PodMonitor"):
        found.append(monitor["spec"]["selector"]["matchLabels"])
    return found


def test_engine_selectors_match_what_the_operator_puts_on_engine_pods(renders):
    selectors = _engine_selectors(renders["monitoring-values"])
    assert len(selectors) == 4
    for selector in selectors:
        for role in RoleName:
            assert selector.items() <= labels("any-model", role).items(), (selector, role)


def test_the_pod_monitor_scrapes_every_ranks_http_port_and_no_kv_port(renders):
    # It named rank 0's port: a pod of 4 ranks showed a quarter of its tokens, its
    # requests and its KV on every engine panel.
    (monitor,) = of_kind(renders["monitoring-values"], "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert "port" not in endpoint  # else Prometheus keeps that one port alone
    (keep,) = [r for r in endpoint["relabelings"] if r["action"] == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    role = RoleSpec(data_parallel_size=4)
    names = [p["name"] for p in container_ports(RoleName.PREFILL, role)]
    kept = [n for n in names if re.fullmatch(keep["regex"], n)]  # Prometheus anchors it
    assert kept == ["http", "http-1", "http-2", "http-3"]
    assert len(names) == 8  # and the four KV ports left out


def test_engine_policy_ports_cover_every_rank(renders):
    ranks = crd.root_schema()["properties"]["spec"]["properties"]["normal"]["properties"][
        "dataParallelSize"
    ]["maximum"]
    policy = next(
        p
        for p in of_kind(renders["defaults-values"], "NetworkPolicy")
        if p["metadata"]["name"].endswith("-engines")
    )
    ranges = {(r["ports"][0]["port"], r["ports"][0]["endPort"]) for r in policy["spec"]["ingress"]}
    assert ranges == {(KV_PORT, KV_PORT + ranks - 1), (HTTP_PORT, HTTP_PORT + ranks - 1)}
