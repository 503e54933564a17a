"""The Kubernetes permissions the operator needs: one declared table, for the Helm chart and docs.

Why a table here: the chart's RBAC must be exactly what the code uses (no
wildcards, nothing extra), and only the operator's code knows that. Two tests
hold it to that: tests/operator/test_rbac.py runs the real operator (kube.py
and kopf together) against the emulated API server and compares every request
it made with `required()`, both ways; tests/helm/ compares the chart's rendered
Role/ClusterRole rules with `required()` in both install scopes.

Two sources of API calls:
- kube.py (the Controller's reads and writes: children, pods, status, Events,
  Secrets);
- kopf itself: watches of every handled resource, patches of the
  ModelDeployment's finalizer and annotations (handlers.configure), peering
  keep-alives, its own warning Events, and its runtime observation of CRDs and
  (for an operator confined to namespaces) of namespaces. kopf's resource scan
  uses the discovery endpoints (/api, /apis), which every authenticated user
  may read (system:discovery), so they need no rule here.

One grant no request uses: `update` of modeldeployments/finalizers, which the
OwnerReferencesPermissionEnforcement admission plugin (on in OpenShift) wants of
whoever sets blockOwnerDeletion in an ownerReference, as every child's does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tandem.operator.spec import GROUP, PLURAL

READ = ("get", "list", "watch")
OWN = (*READ, "create", "patch", "delete")


@dataclass(frozen=True)
class Grant:
    """Verbs on one resource (`plural` or `plural/subresource`) of one API group."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    # Whether the resource itself is cluster-scoped (a ClusterRole even for a namespaced install).
    cluster_scoped: bool = False
    # Checked by an admission plugin, never requested: no API call of the operator uses it.
    admission: bool = False


# Objects in the namespaces served (a Role there, or the ClusterRole when cluster-wide).
SERVED: tuple[Grant, ...] = (
    # Controller.reconcile GETs the model; kopf lists and watches it and patches its
    # finalizer and progress annotations.
    Grant(GROUP, PLURAL, ("get", "list", "watch", "patch")),
    Grant(GROUP, f"{PLURAL}/status", ("patch",)),
    # The children's ownerReferences set blockOwnerDeletion (manifests.Owner): with the
    # OwnerReferencesPermissionEnforcement admission plugin, creating one takes update
    # of the owner's finalizers, or every child's create is refused (403).
    Grant(GROUP, f"{PLURAL}/finalizers", ("update",), admission=True),
    # The children (Controller: list, create, patch, delete, and get when a create finds
    # the name taken; kopf: watch, labelled managed-by=tandem-operator).
    Grant("apps", "deployments", OWN),
    Grant("", "services", OWN),
    Grant("", "configmaps", OWN),
    # Secrets: the copies of the operator's Redis URL it writes for engines
    # (manifests.py), and a get of spec.redis.urlSecretRef to read the queue depth.
    Grant("", "secrets", OWN),
    Grant("policy", "poddisruptionbudgets", OWN),
    # The autoscaler lists engine pods and sets their deletion cost before a scale-down.
    Grant("", "pods", ("list", "patch")),
    # ScaledUp/ScaledDown/SpecApplied/DriftRepaired/InvalidSpec, and kopf's warnings.
    Grant("", "events", ("create",)),
)
# kopf's peering: keep-alives are merge patches of the object's status; the list and
# watch tell a replica whether a peer of higher priority lives.
NAMESPACED_PEERING = Grant("kopf.dev", "kopfpeerings", ("list", "watch", "patch"))
CLUSTER_PEERING = Grant("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"), True)
# kopf's runtime observation: a CRD added or removed while it runs. Without the right
# it scans once at start and logs a warning.
CRDS = Grant("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), True)
# An operator confined to namespaces watches which of them exist (a cluster-wide one
# does not); without the right kopf assumes the listed ones exist and logs a warning.
NAMESPACES = Grant("", "namespaces", ("list", "watch"), True)


def required(*, clusterwide: bool, peering: bool = True) -> tuple[Grant, ...]:
    """Every grant the operator uses, for `tandem operator` cluster-wide or with --namespace."""
    grants = list(SERVED)
    if peering:
        grants.append(CLUSTER_PEERING if clusterwide else NAMESPACED_PEERING)
    grants.append(CRDS)
    if not clusterwide:
        grants.append(NAMESPACES)
    return tuple(grants)


def triples(grants: Iterable[Grant]) -> frozenset[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every verb granted: the unit RBAC rules are compared in."""
    return frozenset((g.group, g.resource, verb) for g in grants for verb in g.verbs)
