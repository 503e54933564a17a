"""Each role's pod count, and who set it: the autoscaler, a bound, a spec edit or a hand.

Pure. The Deployment's spec.replicas is the count's memory between passes; the
ModelDeployment's status and the Deployment's spec-replicas record fill in what a
Deployment alone cannot say (one deleted, one edited by hand, a spec edited).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tandem.operator.autoscaler import Decision
from tandem.operator.drift import ChildKey
from tandem.operator.events import Clamp
from tandem.operator.manifests import SPEC_REPLICAS_ANNOTATION, child_name, spec_replicas_record
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import RoleSpec
from tandem.operator.spec import ModelDeploymentSpec
from tandem.operator.status import Scale

Body = Mapping[str, Any]


def role_replicas(
    spec: ModelDeploymentSpec,
    name: str,
    children: Mapping[ChildKey, Body],
    status: Body,
    decisions: Mapping[RoleName, int],
) -> dict[RoleName, int]:
    """Each role's pod count, within its bounds.

    The Deployment's spec.replicas holds the autoscaler's last decision; a
    Deployment that was deleted comes back with the count the status last
    reported, and a new role starts at spec.<role>.replicas (default
    minReplicas). An edit of spec.<role>.replicas sets the count once, as a
    start the autoscaler moves on from. A changed bound re-clamps the count at once.
    """
    return replica_counts(spec, name, children, status, decisions)[0]


def replica_counts(
    spec: ModelDeploymentSpec,
    name: str,
    children: Mapping[ChildKey, Body],
    status: Body,
    decisions: Mapping[RoleName, int],
) -> tuple[dict[RoleName, int], list[Clamp], list[Scale]]:
    """role_replicas, the Deployment counts it moved into the bounds, and those that
    an edit of spec.<role>.replicas moved."""
    reported = status.get("roles") or {}
    # Zeroed while another model held its served name: it starts anew once free, at
    # spec.<role>.replicas, not at the zero it was held at (clamped to minReplicas).
    restarting = status.get("reason") == "ServedNameTaken"
    counts: dict[RoleName, int] = {}
    clamps: list[Clamp] = []
    edits: list[Scale] = []
    for role_name, role in spec.roles().items():
        deployment = children.get(ChildKey("Deployment", child_name(name, role_name)))
        observed = (deployment or {}).get("spec", {}).get("replicas")
        last = (reported.get(role_name.value) or {}).get("desired")
        edited = _edited_replicas(deployment, role)
        if role_name in decisions:
            count = decisions[role_name]
        elif edited is not None:
            # Within the bounds (validate_spec): no clamp to report beside it.
            counts[role_name] = edited
            if isinstance(observed, int) and observed != edited:
                why = f"spec.{role_name.value}.replicas set to {edited}"
                edits.append(
                    Scale(
                        role_name,
                        observed,
                        edited,
                        f"{role_name.value} scale {observed}->{edited}: {why}",
                    )
                )
            continue
        elif isinstance(observed, int) and not (restarting and observed == 0):
            count = observed
        elif isinstance(last, int) and not restarting:
            count = last
        else:
            count = role.initial_replicas
        counts[role_name] = _bounded(role, count)
        if isinstance(observed, int) and (within := _bounded(role, observed)) != observed:
            # The count the operator last reported, left outside by a bound that
            # moved; any other count was set by hand. A role the autoscaler also
            # decided for was decided from `within` (its Scale says both).
            by_hand = isinstance(last, int) and last != observed
            clamps.append(Clamp(role_name, observed, within, by_hand))
    return counts, clamps, edits


def pending_edits(
    spec: ModelDeploymentSpec, name: str, children: Mapping[ChildKey, Body]
) -> set[RoleName]:
    """Roles whose spec.<role>.replicas changed since their Deployment took it: the
    edit is applied in this pass, and an autoscaler decision made meanwhile waits."""
    return {
        role_name
        for role_name, role in spec.roles().items()
        if _edited_replicas(children.get(ChildKey("Deployment", child_name(name, role_name))), role)
        is not None
    }


def _edited_replicas(deployment: Body | None, role: RoleSpec) -> int | None:
    """spec.<role>.replicas where it changed since the Deployment's count last took it.

    A Deployment without the record (made by an operator before it was kept) has
    its count kept: an upgrade must not reset every model to its starting count.
    """
    annotations = ((deployment or {}).get("metadata") or {}).get("annotations") or {}
    recorded = annotations.get(SPEC_REPLICAS_ANNOTATION)
    if role.replicas is None or recorded is None or recorded == spec_replicas_record(role):
        return None
    return role.replicas


def _bounded(role: RoleSpec, count: int) -> int:
    return min(role.max_replicas, max(role.min_replicas, count))


def clamp_of(clamps: Sequence[Clamp], role: RoleName) -> Clamp | None:
    return next((c for c in clamps if c.role == role), None)


def autoscaler_scale(decision: Decision, clamp: Clamp | None) -> Scale:
    """The autoscaler's change of a role, from the Deployment's count: where a bound
    moved in the same pass, the autoscaler decided from the clamped count."""
    if clamp is None or clamp.by_hand or clamp.replicas != decision.current:
        return Scale(decision.role, decision.current, decision.replicas, decision.reason)
    why = decision.reason.split(": ", 1)[-1]  # after its own "<role> scale 2->1: "
    reason = (
        f"{decision.role.value} scale {clamp.found}->{decision.replicas}: {clamp.bound}, then {why}"
    )
    return Scale(decision.role, clamp.found, decision.replicas, reason)
