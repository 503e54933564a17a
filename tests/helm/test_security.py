"""Every pod the chart makes, in every ci scenario: non-root, locked down, sized and probed."""

from __future__ import annotations

from typing import Any

import pytest
from support.helm import CI_VALUES, pod_specs
from support.manifest_schemas import validate

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
