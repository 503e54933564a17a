"""Where the chart's pods run and what they pull with: imagePullSecrets, the `helm test` pod."""

from __future__ import annotations

import pytest
import yaml
from support.helm import CHART, named, of_kind, pod_specs, render, run_helm, template_args

PLACEMENT = CHART / "ci" / "placement-values.yaml"


def test_pull_secrets_take_the_pod_spec_form_and_plain_names(renders):
    # {name: regcred} is what a pod spec (and most charts) take; plain names were the
    # only form once, and still work. Every pod pulls with both, as {name: ...}.
    specs = pod_specs(renders["placement-values"])
    assert len(specs) == 4  # operator, gateway, redis, the test pod
    for where, spec in specs:
        assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror-pull"}], where


def test_pull_secret_names_that_read_as_other_types_stay_strings(helm):
    manifests = render(helm, sets=["imagePullSecrets[0].name=no"])
    for where, spec in pod_specs(manifests):
        assert spec["imagePullSecrets"] == [{"name": "no"}], where


def test_no_pull_secrets_no_field(renders):
    for where, spec in pod_specs(renders["defaults-values"]):
        assert "imagePullSecrets" not in spec, where


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"name": ""}], "at '/imagePullSecrets/0'"),
        ([{"secretName": "regcred"}], "at '/imagePullSecrets/0'"),
        ([{"name": "regcred", "namespace": "x"}], "at '/imagePullSecrets/0'"),
        ([""], "at '/imagePullSecrets/0'"),
        ([["regcred"]], "at '/imagePullSecrets/0'"),
        # Not a Secret name (a DNS-1123 subdomain): the operator, which passes the names to
        # the engine pods, would refuse to start.
        ([{"name": "Reg_Cred"}], "at '/imagePullSecrets/0/name'"),
        (["regcred-"], "at '/imagePullSecrets/0'"),
        (["x" * 254], "at '/imagePullSecrets/0'"),
    ],
)
def test_malformed_pull_secrets_are_refused(helm, tmp_path, items, message):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"imagePullSecrets": items}))
    result = run_helm(helm, *template_args(CHART, values=[values]))
    assert result.returncode != 0, f"{items} was accepted"
    assert message in result.stderr, result.stderr


def test_the_test_pod_goes_where_the_gateway_may(renders):
    # On a cluster where only labelled, tainted nodes run the gateway's image, a test pod
    # without the gateway's placement would stay Pending.
    manifests = renders["placement-values"]
    gateway = named(manifests, "Deployment", "tandem-gateway")["spec"]["template"]["spec"]
    test = named(manifests, "Pod", "tandem-test-gateway")["spec"]
    assert test["nodeSelector"] == gateway["nodeSelector"] == {"node-pool": "serving"}
    assert test["tolerations"] == gateway["tolerations"]
    assert test["affinity"] == {"nodeAffinity": gateway["affinity"]["nodeAffinity"]}
    # Not the anti-affinity among gateway pods (it would keep the test pod off their
    # nodes) nor their priority.
    assert "podAntiAffinity" in gateway["affinity"]
    assert "priorityClassName" not in test


def test_the_test_pod_gets_no_affinity_from_pod_anti_affinity_alone(helm, tmp_path):
    anti = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}
    gateway = {
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [anti]}}
    }
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"gateway": gateway}))
    test = named(render(helm, values=[values]), "Pod", "tandem-test-gateway")["spec"]
    assert "affinity" not in test


SPREAD_OVER_NODES = {
    "maxSkew": 1,
    "topologyKey": "kubernetes.io/hostname",
    "whenUnsatisfiable": "ScheduleAnyway",
    "matchLabelKeys": ["pod-template-hash"],
}


def _spread(manifests, component):
    """The Deployment's pod spec's topologySpreadConstraints (None: none)."""
    deployment = named(manifests, "Deployment", f"tandem-{component}")
    return deployment["spec"]["template"]["spec"].get("topologySpreadConstraints")


@pytest.mark.parametrize("component", ["operator", "gateway"])
def test_replicas_are_spread_over_nodes_softly_by_default(renders, component):
    # Two replicas on one node go down together with it (a drain, a failure).
    manifests = renders["defaults-values"]
    (spread,) = _spread(manifests, component)
    selector = named(manifests, "Deployment", f"tandem-{component}")["spec"]["selector"]
    assert {k: v for k, v in spread.items() if k != "labelSelector"} == SPREAD_OVER_NODES
    assert spread["labelSelector"] == selector
    # Nothing else is spread: one Redis, a one-shot test pod.
    for kind, spec in pod_specs(manifests):
        if not kind.endswith(("-operator", "-gateway")):
            assert "topologySpreadConstraints" not in spec, kind


@pytest.mark.parametrize("component", ["operator", "gateway"])
def test_a_users_own_spreading_replaces_the_default(helm, tmp_path, component):
    own = {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone"}
    own |= {"whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"a": "b"}}}
    anti = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"a": "b"}}}
    node = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "x", "operator": "Exists"}]}]}
    cases = [
        ({"topologySpreadConstraints": [own]}, [own]),
        (
            {
                "affinity": {
                    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [anti]}
                }
            },
            None,
        ),
        # A node affinity says where, not how far apart: the default spread stays.
        (
            {
                "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": node}
                }
            },
            "default",
        ),
    ]
    for index, (mine, expected) in enumerate(cases):
        values = tmp_path / f"values-{index}.yaml"
        values.write_text(yaml.safe_dump({component: mine}))
        spread = _spread(render(helm, values=[values]), component)
        if expected == "default":
            assert spread[0]["topologyKey"] == "kubernetes.io/hostname", mine
        else:
            assert spread == expected, mine


def test_the_operator_has_a_disruption_budget_while_it_has_a_standby(renders, helm):
    # A drain may take the active replica or the standby, not both.
    manifests = renders["defaults-values"]
    budget = named(manifests, "PodDisruptionBudget", "tandem-operator")["spec"]
    operator = named(manifests, "Deployment", "tandem-operator")
    assert budget["maxUnavailable"] == 1
    assert budget["selector"] == operator["spec"]["selector"]
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    for sets in (["operator.replicas=1"], ["operator.podDisruptionBudget.enabled=false"]):
        budgets = of_kind(render(helm, sets=sets), "PodDisruptionBudget")
        assert [b["metadata"]["name"] for b in budgets] == ["tandem-gateway"], sets
