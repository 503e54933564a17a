"""operator/rbac.py is exactly what the operator uses: every request it makes, and nothing more.

The real operator (kube.py and kopf) runs against the emulated API server,
which logs every request; each one becomes the (apiGroup, resource, verb) an
RBAC rule grants. The scenario walks every code path that touches the API
(adoption of a taken name, a Secret-held Redis URL, a scale-down with
deletion costs and Events, a mode change that deletes a role's children), so
the log must equal the table: a request outside it would be refused by the
chart's RBAC, and a grant never used is one too many (but for the grants an
admission plugin checks, which no request shows). The chart's rules are
compared with the same table in tests/helm/.
"""

from __future__ import annotations

from base64 import b64encode
from typing import Any

import pytest
from support.kube_api import CHILDREN, CLUSTER_PEERINGS, SECRETS
from support.kube_cluster import NAMESPACE, PEERING, Cluster, OperatorReplica, eventually

from tandem.operator import rbac
from tandem.operator.manifests import Owner, selector_labels
from tandem.operator.role_name import RoleName
from tandem.operator.sources import MetricSources
from tandem.operator.spec import GROUP, PLURAL

_VERBS = {"GET": "get", "POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def used(cluster: Cluster, replica: OperatorReplica) -> frozenset[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every resource request `replica` sent."""
    found = set()
    for request in cluster.api:
        resource = request.resource
        if request.url.port != replica.port or resource is None or resource.plural is None:
            continue  # another client, or discovery (/api, /apis: no RBAC rule needed)
        verb = _VERBS[request.method.value]
        if verb == "get" and not request.name:
            verb = "watch" if request.params.get("watch") == "true" else "list"
        plural = (
            f"{resource.plural}/{request.subresource}" if request.subresource else resource.plural
        )
        found.add((resource.group or "", plural, verb))
    return frozenset(found)


def _normal_model() -> dict[str, Any]:
    return {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m"},
        "spec": {
            "model": {"path": "smollm2"},
            "mode": "Normal",  # no spec.redis: the operator's, its URL copied into a Secret
            "normal": {
                "replicas": 2,
                "minReplicas": 1,
                "maxReplicas": 3,
                "scaleDownStabilizationSeconds": 0,
            },
        },
    }


async def _taken_names(cluster: Cluster) -> None:
    """The normal role's children orphaned (their labels kept, no owner): the operator gets
    and adopts them."""
    selector = selector_labels("m", RoleName.NORMAL)
    specs: dict[str, dict[str, Any]] = {
        "ConfigMap": {},
        "Secret": {},
        "Service": {"spec": {"selector": selector}},
        "PodDisruptionBudget": {"spec": {"selector": {"matchLabels": selector}}},
        "Deployment": {
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": selector},
                "template": {"metadata": {"labels": selector}, "spec": {"containers": []}},
            }
        },
    }
    for kind, body in specs.items():
        name = {"ConfigMap": "m-normal-engine", "Secret": "m-normal-redis"}.get(kind, "m-normal")
        metadata = {"name": name, "labels": selector}
        await cluster.api.create(CHILDREN[kind], NAMESPACE, {"metadata": metadata, **body})


@pytest.mark.asyncio
async def test_a_namespaced_operator_uses_exactly_the_table(cluster, metrics, clock):
    url = b64encode(b"redis://model-redis:6379/0").decode()
    await cluster.api.create(
        SECRETS, NAMESPACE, {"metadata": {"name": "model-redis"}, "data": {"url": url}}
    )
    await _taken_names(cluster)
    replica = await cluster.start_operator(lambda: MetricSources(metrics, metrics), clock=clock)
    metrics.default_kv = 0.02  # one pod's worth is plenty: a scale-down with deletion costs

    await cluster.apply(_normal_model())
    await eventually(lambda: cluster.model("m").get("status", {}).get("phase") == "Ready")
    clock.advance(60)  # past the first evaluation's recommendation (the current count)
    await eventually(lambda: cluster.events("ScaledDown"), what="a scale-down")
    await cluster.patch_model(
        "m",
        {
            "spec": {
                "mode": "Disaggregated",
                # the model's own Redis now: the operator's copy goes, the queue is read here
                "redis": {"urlSecretRef": {"name": "model-redis"}},
                "normal": None,
                "prefill": {"minReplicas": 1},
                "decode": {"minReplicas": 1},
            }
        },
    )
    normal = [("ConfigMap", "m-normal-engine"), ("Secret", "m-normal-redis")]
    normal += [(kind, "m-normal") for kind in ("Deployment", "Service", "PodDisruptionBudget")]
    await eventually(
        lambda: all(cluster.child(kind, name) is None for kind, name in normal),
        what="the normal role's children all deleted",
    )

    want = rbac.triples(g for g in rbac.required(clusterwide=False) if not g.admission)
    got = used(cluster, replica)
    assert got - want == set(), "requests the chart's RBAC would refuse"
    assert want - got == set(), "grants the operator never used"


@pytest.mark.asyncio
async def test_a_cluster_wide_operator_uses_only_the_table(cluster, metrics, clock):
    await cluster.api.create(CLUSTER_PEERINGS, None, {"metadata": {"name": PEERING}})
    replica = await cluster.start_operator(
        lambda: MetricSources(metrics, metrics), clock=clock, namespaces=()
    )
    await cluster.apply({**_normal_model(), "spec": {"model": {"path": "smollm2"}, "normal": {}}})
    await eventually(lambda: (cluster.model("m") or {}).get("status", {}).get("phase") == "Ready")

    got = used(cluster, replica)
    assert got - rbac.triples(rbac.required(clusterwide=True)) == set()
    assert rbac.triples([rbac.CLUSTER_PEERING, rbac.CRDS]) <= got
    assert not any(resource == "namespaces" for _, resource, _ in got), "cluster-wide: no need"


def test_the_table_grants_no_wildcards_and_no_verb_twice():
    for clusterwide in (True, False):
        grants = rbac.required(clusterwide=clusterwide)
        keys = [(g.group, g.resource) for g in grants]
        assert len(keys) == len(set(keys))
        for grant in grants:
            assert "*" not in (grant.group, grant.resource, *grant.verbs)
            assert len(grant.verbs) == len(set(grant.verbs))


def test_blocking_owner_deletion_is_granted_for_the_admission_plugin():
    # The children's ownerReferences set blockOwnerDeletion: with the
    # OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift), every
    # create of a child is refused (403) without update of the owner's finalizers.
    assert Owner("m", NAMESPACE, "uid").reference()["blockOwnerDeletion"] is True
    for clusterwide in (True, False):
        grants = rbac.required(clusterwide=clusterwide)
        (grant,) = [g for g in grants if g.resource == f"{PLURAL}/finalizers"]
        assert (grant.group, grant.verbs, grant.admission) == (GROUP, ("update",), True)
