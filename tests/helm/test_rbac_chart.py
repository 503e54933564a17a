"""The chart's RBAC is exactly operator/rbac.py's table, in both install scopes.

tests/operator/test_rbac.py proves the table is what the operator's code
uses; this proves the chart grants the table: nothing missing, nothing more,
no wildcards, bound to the operator's ServiceAccount only.
"""

from __future__ import annotations

from typing import Any

from support.helm import NAMESPACE, named, of_kind, render

from tandem.operator import rbac

OPERATOR = "tandem-operator"


def _triples(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    found = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, "no resourceNames, no URLs"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {role['kind']}"
                    found.add((group, resource, verb))
    return found


def _bound_to_the_operator(manifests: list[dict[str, Any]], kind: str) -> None:
    """Every binding of `kind` binds only the operator's ServiceAccount, to a role of the chart."""
    roles = {(r["metadata"].get("namespace"), r["metadata"]["name"]) for r in manifests}
    for binding in of_kind(manifests, kind):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": OPERATOR, "namespace": NAMESPACE}
        ]
        role = (binding["metadata"].get("namespace"), binding["roleRef"]["name"])
        assert role in roles, f"{kind} {binding['metadata']['name']} binds a role not made here"


def test_cluster_scope_grants_exactly_the_table(renders):
    manifests = renders["defaults-values"]
    assert of_kind(manifests, "Role") == [] and of_kind(manifests, "RoleBinding") == []
    (role,) = of_kind(manifests, "ClusterRole")
    assert _triples(role) == rbac.triples(rbac.required(clusterwide=True))
    _bound_to_the_operator(manifests, "ClusterRoleBinding")


def test_namespace_scope_grants_exactly_the_table_in_each_namespace(renders):
    manifests = renders["namespace-scoped-values"]
    roles = of_kind(manifests, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    namespaced = rbac.triples([*rbac.SERVED, rbac.NAMESPACED_PEERING])
    for role in roles:
        assert _triples(role) == namespaced
    (discovery,) = of_kind(manifests, "ClusterRole")
    assert _triples(discovery) == rbac.triples([rbac.CRDS, rbac.NAMESPACES])
    assert namespaced | _triples(discovery) == rbac.triples(rbac.required(clusterwide=False))
    _bound_to_the_operator(manifests, "RoleBinding")
    _bound_to_the_operator(manifests, "ClusterRoleBinding")


def test_the_operator_may_block_its_childrens_owner_deletion(renders):
    # The children's ownerReferences set blockOwnerDeletion; with the
    # OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) that takes
    # update of the owner's finalizers, or every create of a child is refused (403).
    grant = ("serving.tandem.dev", "modeldeployments/finalizers", "update")
    for name, kind in (("defaults-values", "ClusterRole"), ("namespace-scoped-values", "Role")):
        roles = of_kind(renders[name], kind)  # the roles of the served namespaces
        assert roles, name
        for role in roles:
            assert grant in _triples(role), (name, role["metadata"])


def test_namespace_scope_without_cluster_reads_has_no_cluster_role(helm):
    sets = ["operator.scope=namespace", "operator.clusterDiscovery=false"]
    manifests = render(helm, sets=sets)
    assert of_kind(manifests, "ClusterRole") == []
    assert of_kind(manifests, "ClusterRoleBinding") == []
    assert [r["metadata"]["namespace"] for r in of_kind(manifests, "Role")] == [NAMESPACE]


def test_cluster_scoped_grants_sit_in_cluster_roles(renders):
    """A Role cannot grant a cluster-scoped resource: the table's flag decides the kind."""
    cluster_scoped = {
        (g.group, g.resource)
        for g in rbac.required(clusterwide=False) + rbac.required(clusterwide=True)
        if g.cluster_scoped
    }
    for role in of_kind(renders["namespace-scoped-values"], "Role"):
        assert not {(group, res) for group, res, _ in _triples(role)} & cluster_scoped


def test_the_peering_object_is_the_one_the_operator_joins(renders):
    for name, kind in (
        ("defaults-values", "ClusterKopfPeering"),
        ("namespace-scoped-values", "KopfPeering"),
    ):
        manifests = renders[name]
        env = _env(named(manifests, "Deployment", OPERATOR))
        peerings = of_kind(manifests, kind)
        assert {p["metadata"]["name"] for p in peerings} == {env["TANDEM_OPERATOR_PEERING_NAME"]}
        if kind == "KopfPeering":
            served = env["TANDEM_OPERATOR_NAMESPACES"].split(",")
            assert sorted(p["metadata"]["namespace"] for p in peerings) == sorted(served)
        else:
            assert "TANDEM_OPERATOR_NAMESPACES" not in env, "cluster-wide: every namespace"


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "<from>") for e in container["env"]}
