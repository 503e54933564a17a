"""Every pod the chart makes, in every ci scenario: non-root, locked down, sized and probed."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
import yaml
from support.helm import CI_VALUES, named, pod_specs, render
from support.manifest_schemas import validate

from tandem.operator.settings import OperatorSettings, add_arguments, from_args

IDS = [path.stem for path in CI_VALUES]
# `helm test` pods run once and exit: a probe would watch nothing. activeDeadlineSeconds
# bounds them instead (asserted below).
ONE_SHOT = "Pod/"


def _pods(renders: dict[str, list[dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{name}:{kind}", spec) for name in IDS for kind, spec in pod_specs(renders[name])]


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_every_scenario_has_the_three_components_pods(renders):
    kinds = {kind.split("/")[0] for kind, _ in pod_specs(renders["defaults-values"])}
    assert kinds == {"Deployment", "StatefulSet", "Pod"}
    assert len(pod_specs(renders["defaults-values"])) == 4  # operator, gateway, redis, test


def test_pods_run_as_a_fixed_non_root_user_with_seccomp(renders):
    for where, spec in _pods(renders):
        security = spec["securityContext"]
        assert security["runAsNonRoot"] is True, where
        assert isinstance(security["runAsUser"], int) and security["runAsUser"] > 0, where
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, where


def test_containers_are_locked_down(renders):
    for where, spec in _pods(renders):
        for container in _containers(spec):
            security = container["securityContext"]
            what = f"{where} {container['name']}"
            assert security["allowPrivilegeEscalation"] is False, what
            assert security["capabilities"] == {"drop": ["ALL"]}, what
            assert security["readOnlyRootFilesystem"] is True, what
            assert security.get("privileged") is not True, what
            assert security.get("runAsUser", 1) != 0, what


def test_writable_paths_are_volumes(renders):
    """A read-only root: every mount is a volume of the pod, and Redis' /data is one."""
    for name in IDS:
        for manifest in renders[name]:
            if manifest["kind"] not in ("Deployment", "StatefulSet", "Pod"):
                continue
            spec = manifest["spec"]
            pod = spec.get("template", {}).get("spec", spec)
            claims = [c["metadata"]["name"] for c in spec.get("volumeClaimTemplates", [])]
            volumes = {v["name"] for v in pod.get("volumes", [])} | set(claims)
            mounts = {
                m["name"]: m["mountPath"]
                for c in pod["containers"]
                for m in c.get("volumeMounts", [])
            }
            assert set(mounts) <= volumes, f"{name}: {manifest['metadata']['name']}"
            if manifest["kind"] == "StatefulSet":  # Redis' append-only file
                assert mounts.get("data") == "/data", name


def test_every_container_has_requests_and_limits(renders):
    for where, spec in _pods(renders):
        for container in _containers(spec):
            resources = container["resources"]
            what = f"{where} {container['name']}"
            assert {"cpu", "memory"} <= set(resources["requests"]), what
            assert {"cpu", "memory"} <= set(resources["limits"]), what


def test_every_long_running_container_is_probed(renders):
    for where, spec in _pods(renders):
        if where.split(":", 1)[1].startswith(ONE_SHOT):
            assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] > 0, where
            continue
        for container in spec["containers"]:
            assert "livenessProbe" in container, f"{where} {container['name']}"
            assert "readinessProbe" in container, f"{where} {container['name']}"


def test_only_the_operator_holds_an_api_token(renders):
    for where, spec in _pods(renders):
        operator = spec.get("serviceAccountName", "").endswith("-operator")
        assert spec.get("automountServiceAccountToken", True) is operator, where


@pytest.mark.parametrize(
    "field",
    [{"unknownField": 1}, {"replicas": "two"}],
    ids=["unknown-field", "wrong-type"],
)
def test_the_validator_refuses_a_bad_deployment(renders, field):
    deployment = next(m for m in renders["defaults-values"] if m["kind"] == "Deployment")
    bad = {**deployment, "spec": {**deployment["spec"], **field}}
    with pytest.raises(Exception, match=r"unknownField|two"):
        validate(bad)


def test_the_validator_refuses_a_bad_monitor(renders):
    monitor = next(m for m in renders["monitoring-values"] if m["kind"] == "ServiceMonitor")
    with pytest.raises(Exception, match="endpoint"):
        validate({**monitor, "spec": {**monitor["spec"], "endpoint": []}})


def _engine_settings(manifests: list[dict[str, Any]]) -> OperatorSettings:
    """The settings the operator reads from its Deployment's environment."""
    operator = named(manifests, "Deployment", "tandem-operator")["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in operator["containers"][0]["env"] if "value" in e}
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args([]), env)


IDS_FIELDS = {"runAsUser", "runAsGroup", "fsGroup"}


@pytest.mark.parametrize("how", ["values-file", "set"])
def test_a_null_user_leaves_the_ids_to_the_platform(helm, tmp_path, how):
    # OpenShift's restricted-v2 SCC refuses fixed ids outside the namespace's range and
    # assigns its own to a pod that sets none. Helm removes a null key: both forms.
    keys = ["operator.runAsUser", "operator.engineRunAsUser", "gateway.runAsUser"]
    keys.append("redis.runAsUser")
    if how == "set":
        manifests = render(helm, sets=[f"{key}=null" for key in keys])
    else:
        values = tmp_path / "values.yaml"
        nulls: dict[str, Any] = {}
        for key in keys:
            block, name = key.split(".")
            nulls.setdefault(block, {})[name] = None
        values.write_text(yaml.safe_dump(nulls))
        manifests = render(helm, values=[values])
    pods = pod_specs(manifests)
    assert len(pods) == 4  # operator, gateway, redis, test
    for where, spec in pods:
        security = spec["securityContext"]
        assert not IDS_FIELDS & security.keys(), where
        assert security["runAsNonRoot"] is True, where
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for container in _containers(spec):
            assert container["securityContext"]["runAsNonRoot"] is True, where
    assert _engine_settings(manifests).engine_run_as_user is None
    for manifest in manifests:
        validate(manifest)


def test_the_engine_pods_user_reaches_the_operator(renders, helm):
    assert _engine_settings(renders["defaults-values"]).engine_run_as_user == 10001
    manifests = render(helm, sets=["operator.engineRunAsUser=1000650000"])
    assert _engine_settings(manifests).engine_run_as_user == 1000650000
    # One component's null leaves the others' ids as they are.
    manifests = render(helm, sets=["gateway.runAsUser=null"])
    operator = named(manifests, "Deployment", "tandem-operator")["spec"]["template"]["spec"]
    assert operator["securityContext"]["runAsUser"] == 10001
    assert _engine_settings(manifests).engine_run_as_user == 10001
