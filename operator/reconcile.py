"""Pure reconciliation: a ModelDeployment and what exists -> what to create, patch and delete.

`plan` reads no cluster and keeps no state: given the object (spec and last
status), the children found by label, the autoscaler's decisions and the time,
it returns the actions, the Events that report them and the new status. The
controller (controller.py) does the reading and the writing around it;
drift.py compares a child with its manifest, replica_counts.py sets each role's count,
events.py words the Events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tandem.operator.autoscaler import Decision
from tandem.operator.drift import ChildKey, ChildPatch, drift, repair_patch
from tandem.operator.events import Clamp, Event, events, refusal_event, with_adoptions
from tandem.operator.found_children import (
    as_found,
    old_mode_ready,
    old_pods_may_run,
    owned_by,
    replaces_pods,
    role_counts,
    role_of,
)
from tandem.operator.manifests import (
    OperatorDefaults,
    Owner,
    build_manifests,
    child_name,
    pods_of,
)
from tandem.operator.pod_trouble import role_trouble
from tandem.operator.replica_counts import (
    autoscaler_scale,
    clamp_of,
    pending_edits,
    replica_counts,
)
from tandem.operator.role_name import RoleName
from tandem.operator.served_names import (
    applied_name,
    queues_digest,
    retiring_names,
    served_queues,
)
from tandem.operator.setting_changes import setting_changes
from tandem.operator.spec import ModelDeploymentSpec
from tandem.operator.status import (
    Scale,
    refusal_status,
    status_patch,
    valid_status,
)
from tandem.operator.status_model import Phase
from tandem.operator.validation import InvalidSpec, validate_spec

Body = Mapping[str, Any]


@dataclass(frozen=True)
class Plan:
    creates: tuple[dict[str, Any], ...] = ()
    patches: tuple[ChildPatch, ...] = ()
    deletes: tuple[ChildKey, ...] = ()
    # The status merge patch; None when the status is already right.
    status: dict[str, Any] | None = None
    events: tuple[Event, ...] = ()
    # Counts put back within their bounds (the autoscaler's changes are the caller's).
    clamps: tuple[Clamp, ...] = ()
    # Counts an edit of spec.<role>.replicas set.
    edits: tuple[Scale, ...] = ()

    @property
    def shrinking(self) -> tuple[RoleName, ...]:
        """Roles this plan (not the autoscaler) scales down: their pods need deletion costs."""
        clamped = [c.role for c in self.clamps if c.replicas < c.found]
        return (*clamped, *(e.role for e in self.edits if e.replicas < e.current))

    @property
    def touches_children(self) -> bool:
        return bool(self.creates or self.patches or self.deletes)


def plan(
    model: Body,
    children: Sequence[Body],
    defaults: OperatorDefaults,
    *,
    now: str,
    scaled: Mapping[RoleName, Decision] | None = None,
    pods: Sequence[Body] = (),
    holder: str | None = None,
    undone: Mapping[ChildKey, ChildPatch] | None = None,
) -> Plan:
    """What to do so that the children and the status match the ModelDeployment `model`.

    `scaled` are the autoscaler's decisions that change a role's count (roles it
    did not change are left out); `pods` are the model's engine pods, whose
    troubles the status quotes; `holder` says which ModelDeployment holds this
    one's servedModelName, if any (`served_name_holder`); `undone`, each child's last
    repair that changed nothing (PlanWriter.undone): not written again while the same.
    """
    meta = model["metadata"]
    previous = model.get("status") or {}
    found = {ChildKey(c["kind"], c["metadata"]["name"]): c for c in children}
    try:
        spec = validate_spec(model.get("spec"), name=meta["name"])
    except InvalidSpec as error:
        return _refusal(model, "InvalidSpec", str(error), now, found=found)
    queues = queues_digest(model, defaults.redis_url)
    if holder is not None:
        return _name_taken(model, spec, found, holder, now, queues)
    owner = Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    # A decision made from a count the spec's edit replaces waits for the next pass.
    edited = pending_edits(spec, owner.name, found)
    # While the old mode's pods serve after a mode change, each new role runs a pod at
    # least: a role at zero counted as ready at once, and the serving pods were deleted
    # with none loading the model to take over. The autoscaler may take it to zero after.
    handing_over = any(old_mode_ready(spec, found).values())
    scaled = {
        role: d
        for role, d in (scaled or {}).items()
        if role not in edited and not (handing_over and d.replicas == 0)
    }
    decisions = {role: d.replicas for role, d in scaled.items()}
    replicas, clamps, edits = replica_counts(spec, owner.name, found, previous, decisions)
    if handing_over:
        replicas = {role: max(count, 1) for role, count in replicas.items()}
    desired = build_manifests(owner, spec, replicas, defaults)

    creates: list[dict[str, Any]] = []
    patches: list[ChildPatch] = []
    for manifest in desired:
        key = ChildKey(manifest["kind"], manifest["metadata"]["name"])
        actual = found.get(key)
        if actual is None:
            creates.append(manifest)
            continue
        paths = drift(manifest, actual)
        if not paths:
            continue
        repair = ChildPatch(key.kind, key.name, repair_patch(manifest, actual), paths)
        if (undone or {}).get(key) != repair:  # the same repair changed nothing last time
            generation = actual["metadata"].get("generation")
            patches.append(replace(repair, generation=generation))
    wanted = {ChildKey(m["kind"], m["metadata"]["name"]): m for m in desired}

    # Deployments whose pods this pass replaces: only a new pod template does. A count
    # adds or removes pods, which the ready counts say, and metadata (the annotation an
    # edit of spec.<role>.replicas moves with it) replaces none: calling those a rollout
    # flapped Ready at every scale.
    rolled = {ChildKey(p.kind, p.name) for p in patches if replaces_pods(p.drift)}
    # A status the Deployment controller has not caught up with says nothing new: it
    # is rolling if the last pass said so (a new template then, or its rollout).
    was_rolling = previous.get("reason") == "RollingOut"
    deployments = {r: ChildKey("Deployment", child_name(owner.name, r)) for r in spec.roles()}
    counts = {
        role_name: role_counts(
            found.get(key),
            replicas[role_name],
            key in rolled,
            was_rolling,
            role_trouble(pods_of(pods, role_name)),
        )
        for role_name, key in deployments.items()
    }
    gone = set(found) - set(wanted)
    settled = all(c.ready >= c.desired and not c.rolling for c in counts.values())
    if not settled:
        # After a mode change the old mode's roles serve until the new ones are ready
        # (loading a model takes minutes): the model never serves nothing meanwhile.
        # So do a current role's old children (the operator's Redis Secret after a
        # switch to spec.redis): its old pods read them until the new ones are ready,
        # and one restarted meanwhile without them would not start.
        gone = {key for key in gone if role_of(found[key]) is None}
    # The old mode's Deployments kept serving: the status says so, not "nothing ready".
    kept = set(found) - gone
    outgoing = {role.value: ready for role, ready in old_mode_ready(spec, found, kept).items()}
    deletes = tuple(sorted(gone, key=lambda k: (k.kind, k.name)))
    scales = [autoscaler_scale(d, clamp_of(clamps, role)) for role, d in scaled.items()]
    scales += [c.scale for c in clamps if not c.by_hand and c.role not in scaled]
    scales += edits
    last_scale = scales[-1].record(now) if scales else None
    served = spec.served_model_name(owner.name)
    # Pods of before a rename (or of the old mode) serve on meanwhile: their names stay
    # claimed (served_names.py) until no such pod is left.
    rolling = any(c.rolling for c in counts.values())
    replacing = rolling or any(outgoing.values()) or old_pods_may_run(found)
    retiring = retiring_names(previous, served) if replacing else ()
    new_status = valid_status(
        meta, counts, previous, now, last_scale, (served, queues), outgoing, retiring
    )
    said = events(
        model,
        creates,
        patches,
        [f"{k.kind} {k.name}" for k in deletes],
        scales,
        [c for c in clamps if c.by_hand],
        setting_changes(owner.name, tuple(spec.roles()), found, wanted),
    )
    # Children found by the model's labels that are not its own yet (orphaned with
    # their labels, or an earlier model's of its name before the garbage collector
    # came): the patches take them over, said on a first pass too.
    adopted = [f"{k.kind} {k.name}" for k in found if k in wanted and not owned_by(found[k], owner)]
    return Plan(
        creates=tuple(creates),
        patches=tuple(patches),
        deletes=deletes,
        status=status_patch(previous, new_status),
        events=with_adoptions(said, adopted),
        clamps=tuple(clamps),
        edits=tuple(edits),
    )


def refused(model: Body, error: str, *, now: str) -> Plan:
    """The plan once the API server refused a child the spec builds: Invalid, in its words.

    The spec passed the CRD and the operator's checks, so only a rule the API
    server alone knows (a toleration's value with operator Exists, a label key's format)
    stands in the way; retrying cannot help, a changed spec can.
    """
    return _refusal(model, "InvalidSpec", f"the API server refused a child object: {error}", now)


def forbidden(model: Body, error: str, *, now: str) -> Plan:
    """The plan once the API server forbade a child's write (403: a ResourceQuota's
    object count, a terminating namespace, an admission policy, RBAC): Degraded, in its
    words. Nothing in the spec is wrong, so every pass tries again."""
    why = f"the API server forbade writing a child object: {error}"
    return _refusal(model, "Forbidden", why, now, phase=Phase.DEGRADED)


def child_taken(model: Body, why: str, *, now: str) -> Plan:
    """The plan when a child's name is held by an object another controller owns: Invalid
    until it is renamed or deleted (a later pass then creates the child)."""
    return _refusal(model, "ChildTaken", why, now)


def _refusal(
    model: Body,
    reason: str,
    why: str,
    now: str,
    *,
    roles: dict[str, Any] | None = None,
    patches: tuple[ChildPatch, ...] = (),
    phase: Phase = Phase.INVALID,
    found: Mapping[ChildKey, Body] | None = None,
) -> Plan:
    """Phase Invalid (or `phase`): no child created or changed but by `patches`; `roles`
    or the old counts. With the children `found`, the names pods of before a rename
    serve are let go once none can run (a refusal applies no spec: kept, they would
    hold a name no pod serves for as long as the refusal lasts)."""
    meta, previous = model["metadata"], model.get("status") or {}
    status = refusal_status(meta, why, previous, now, reason, phase)
    if roles is None and found is not None and previous.get("roles"):
        roles = as_found(meta["name"], previous["roles"], found)
    if roles is not None:
        status["roles"] = roles
    if found is not None and not old_pods_may_run(found):
        status["retiringServedModelNames"] = None
    return Plan(
        patches=patches,
        status=status_patch(previous, status),
        events=refusal_event(previous, status),
    )


def _name_taken(
    model: Body,
    spec: ModelDeploymentSpec,
    found: Mapping[ChildKey, Body],
    holder: str,
    now: str,
    queues: str,
) -> Plan:
    """Another model holds this one's name: this one does not serve it until it is free.

    Pods that serve another name (a rename refused), or the name on other queues (a
    move to another Redis refused, `queues` the spec's), are left serving, as an invalid
    edit leaves them. Pods that would serve the held name go to zero rather than away,
    so the status counts them down and nothing is rebuilt once the name is free; none
    is created. Those of a mode the spec just left too: they served the name as well.
    """
    name = model["metadata"]["name"]
    asked = spec.served_model_name(name)
    why = (
        f"servedModelName {asked!r} is {holder}: this one does not serve it "
        "until the name is free (rename or delete one of them)"
    )
    serving = applied_name(model)
    if serving is not None and serving != asked:
        why += f"; its pods serve {serving!r} meanwhile"
        return _refusal(model, "ServedNameTaken", why, now, found=found)
    if serving is not None and served_queues(model) not in (None, queues):
        why += "; its pods serve it on the Redis of its last applied spec meanwhile"
        return _refusal(model, "ServedNameTaken", why, now, found=found)
    patches: list[ChildPatch] = []
    roles: dict[str, Any] = {}
    keys = {role: ChildKey("Deployment", child_name(name, role)) for role in RoleName}
    for role_name in (r for r in RoleName if r in spec.roles() or keys[r] in found):
        key = keys[role_name]
        deployment = found.get(key)
        counts = role_counts(deployment, 0, False, False, None)
        roles[role_name.value] = {"desired": 0, "replicas": counts.replicas, "ready": counts.ready}
        if deployment is not None and deployment.get("spec", {}).get("replicas") != 0:
            patch = {"spec": {"replicas": 0}}
            patches.append(ChildPatch(key.kind, key.name, patch, ("spec.replicas",)))
    return _refusal(
        model, "ServedNameTaken", why, now, roles=roles, patches=tuple(patches), found=found
    )
