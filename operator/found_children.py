"""What a model's children say as found: each role's counts, and what keeps its pods.

Pure functions of the children (Deployments with their status) that a pass reads,
for reconcile.plan: the counts its status reports, whether pods of an older
template or mode may still run, and which repairs replace pods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.operator.drift import ChildKey
from tandem.operator.manifests import ROLE_LABEL, Owner, child_name
from tandem.operator.pod_trouble import PodTrouble
from tandem.operator.role_name import RoleName
from tandem.operator.spec import ModelDeploymentSpec
from tandem.operator.status import RoleCounts, Stall

Body = Mapping[str, Any]


def as_found(name: str, roles: Mapping[str, Any], found: Mapping[ChildKey, Body]) -> dict:
    """The status's role counts with each role's pods as its Deployment has them now
    (none where it is gone), the desired count as it was: a refusal applies no spec,
    but the pods it leaves serving may still lose readiness, or their Deployment."""
    counted = {}
    for role, counts in roles.items():
        if role not in set(RoleName) or not isinstance(counts, Mapping):
            counted[role] = counts  # not a role this operator makes: as it was
            continue
        deployment = found.get(ChildKey("Deployment", child_name(name, RoleName(role))))
        status = (deployment or {}).get("status") or {}
        counted[role] = {
            **counts,
            "replicas": int(status.get("replicas") or 0),
            "ready": int(status.get("readyReplicas") or 0),
        }
    return counted


def stall_of(conditions: list[Body]) -> Stall | None:
    """What keeps a Deployment from progressing, if anything: a replica failure (a quota,
    an admission webhook: no pod can even be made) before a passed deadline."""
    by_type = {c.get("type"): c for c in conditions}
    failure = by_type.get("ReplicaFailure") or {}
    if failure.get("status") == "True":
        return Stall("ReplicaFailure", str(failure.get("message") or failure.get("reason") or ""))
    progressing = by_type.get("Progressing") or {}
    if progressing.get("status") == "False":
        return Stall("ProgressDeadlineExceeded", str(progressing.get("message") or ""))
    return None


def old_pods_may_run(found: Mapping[ChildKey, Body]) -> bool:
    """Whether a Deployment may still run pods of an older template: its controller has
    not caught up with its spec yet, or has not replaced all its pods."""
    for key, child in found.items():
        if key.kind != "Deployment":
            continue
        status = child.get("status") or {}
        generation = int(child["metadata"].get("generation") or 0)
        if int(status.get("observedGeneration") or 0) < generation:
            return True
        if int(status.get("updatedReplicas") or 0) < int(status.get("replicas") or 0):
            return True
    return False


def old_mode_ready(
    spec: ModelDeploymentSpec,
    found: Mapping[ChildKey, Body],
    among: set[ChildKey] | None = None,
) -> dict[RoleName, int]:
    """Ready pods of each Deployment of a role the spec's mode no longer has (`among`
    those children only, if given): after a mode change, the pods serving meanwhile."""
    return {
        role: (child.get("status") or {}).get("readyReplicas") or 0
        for key, child in found.items()
        if key.kind == "Deployment"
        and (among is None or key in among)
        and (role := role_of(child)) is not None
        and role not in spec.roles()
    }


def owned_by(child: Body, owner: Owner) -> bool:
    """Whether a child's owner references name the model (by uid: not a deleted one's)."""
    refs = child["metadata"].get("ownerReferences") or []
    return any(ref.get("uid") == owner.uid for ref in refs)


def role_of(child: Body) -> RoleName | None:
    """The role a child belongs to (its role label), if any."""
    value = (child["metadata"].get("labels") or {}).get(ROLE_LABEL)
    return RoleName(value) if value in {r.value for r in RoleName} else None


def role_counts(
    deployment: Body | None,
    desired: int,
    changing: bool,
    was_rolling: bool,
    trouble: PodTrouble | None,
) -> RoleCounts:
    if deployment is None:
        # Not made yet (a new model, a new mode's role), or deleted under a serving model:
        # no pods to replace, so no rollout (one read as rolling hid the outage of a
        # deleted Deployment as RollingOut, never Degraded).
        return RoleCounts(desired=desired)
    status = deployment.get("status") or {}
    replicas = int(status.get("replicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    stale = was_rolling and int(status.get("observedGeneration") or 0) < int(
        deployment["metadata"].get("generation") or 0
    )
    stall = stall_of(status.get("conditions") or [])
    # A role at zero with no pods has none to replace: a new template there is no rollout.
    rolling = (desired > 0 or replicas > 0) and (changing or stale or updated < replicas)
    return RoleCounts(
        desired=desired,
        replicas=replicas,
        ready=int(status.get("readyReplicas") or 0),
        rolling=rolling,
        stall=stall,
        trouble=trouble,
    )


def replaces_pods(drift: Sequence[str]) -> bool:
    """Whether a Deployment patch of these drifted paths rolls its pods out: only a new
    pod template does (a repaired spec.strategy or revisionHistoryLimit replaces none)."""
    return any(path == "spec.template" or path.startswith("spec.template.") for path in drift)
