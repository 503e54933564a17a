"""Pure status derivation: per-role pod counts -> phase, reason and conditions.

The shape is status_model.py's (the CRD's status schema). The phase answers
"is the model served as asked?":

- Ready: every role has its desired pods ready and nothing is rolling; or a Ready
  model scales up, every pod it served with still ready (reason ScalingUp, Progressing
  too; a role's floor is its status `serving`), as a Deployment stays Available while
  its new pods start: the autoscaler's every scale-up turned Ready False, and alerts
  and dashboards read an outage.
- Pending: no pod of any role is ready yet (a new model, or scaling from zero).
- Progressing: some pods ready, others starting, rolling or being added.
- Degraded: a role is short of ready pods for a reason that will not pass by
  itself (an engine that keeps exiting, an image that cannot be pulled:
  pod_trouble.py quotes the pod), a Deployment reports it cannot progress, or
  a role that was serving lost ready pods it still should have (eviction, node
  loss) outside a rollout or a scale-up.
- Invalid: the spec was refused; the reason is in the Invalid condition.

Degraded needs the previous status to tell "lost" from "not there yet": only a
model that was Ready (or already Degraded) can degrade, and a role whose
desired count just went up is scaling, not degraded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.operator.pod_trouble import PodTrouble
from tandem.operator.role_name import RoleName
from tandem.operator.status_model import ConditionType, Phase

Body = Mapping[str, Any]
# Status fields are bounded by the CRD schema (status_model.py).
_MAX_REASON = 1024
_MAX_MESSAGE = 32768


@dataclass(frozen=True)
class Scale:
    """A change of a role's replicas worth reporting: the autoscaler's, or a bound's."""

    role: RoleName
    current: int
    replicas: int
    # Starts "<role> scale <current>-><replicas>: ", as the autoscaler's reasons do.
    reason: str

    @property
    def event_reason(self) -> str:
        return "ScaledUp" if self.replicas > self.current else "ScaledDown"

    def record(self, now: str) -> dict[str, Any]:
        """status.lastScale."""
        return {
            "role": self.role.value,
            "from": self.current,
            "to": self.replicas,
            "reason": self.reason[:_MAX_REASON],
            "time": now,
        }


@dataclass(frozen=True)
class Stall:
    """A Deployment condition that says it cannot progress, in its own words."""

    reason: str  # ProgressDeadlineExceeded (pods never came up) or ReplicaFailure
    message: str  # the condition's message, e.g. a quota the pods would exceed


@dataclass(frozen=True)
class RoleCounts:
    """One role as its Deployment reports it."""

    desired: int
    replicas: int = 0
    ready: int = 0
    # Pods being replaced or added: a new template or count not yet rolled out.
    rolling: bool = False
    # The Deployment says it cannot progress (deadline exceeded, replica failure).
    stall: Stall | None = None
    # What its pods say keeps one of them from serving, if anything.
    trouble: PodTrouble | None = None


def valid_status(
    meta: Body,
    counts: Mapping[RoleName, RoleCounts],
    previous: Body,
    now: str,
    last_scale: Mapping[str, Any] | None = None,
    served: tuple[str, str] | None = None,
    outgoing: Mapping[str, int] | None = None,
    retiring: Sequence[str] = (),
) -> dict[str, Any]:
    """The full status of a ModelDeployment whose spec is valid; `served`: the name its
    pods serve (once rolled) and the digest of their queues' Redis; `outgoing`: the
    ready pods of roles a mode change is replacing, which serve until the new roles are
    ready; `retiring`: the names pods of before a rename still serve."""
    phase, reason, message = _phase(counts, previous)
    serving = {role: n for role, n in (outgoing or {}).items() if n}
    old = ", ".join(f"{role} {n} ready" for role, n in serving.items())
    if serving and phase is Phase.DEGRADED:
        # A new pod's trouble (an image that does not pull) is what to fix, but the old
        # mode's pods still serve: read alone, "0/1 ready" looked like an outage.
        message = f"{message}; changing mode: {old} serve meanwhile"
    elif serving and phase in (Phase.PENDING, Phase.PROGRESSING):
        # Not "no engine pod ready yet": the old mode's pods take every request meanwhile.
        # A new pod's trouble (no node takes it) stays the reason: it is what to fix.
        phase = Phase.PROGRESSING
        if reason in ("PodsStarting", "RollingOut"):
            summary = _summary(counts)
            reason = "RollingOut"
            message = f"changing mode: {old} serve until the new roles are ready: {summary}"
        else:
            message = f"{message}; changing mode: {old} serve meanwhile"
    # The CRD's maxLength: a pod's or Deployment's own words (a webhook's denial listing
    # every violation) could be longer, and a status the API refuses is never updated.
    message = message[:_MAX_MESSAGE]
    status: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "phase": phase.value,
        "reason": reason,
        "message": message,
        "roles": {
            role.value: {
                "desired": c.desired,
                "replicas": c.replicas,
                "ready": c.ready,
                "serving": _serving(c, (previous.get("roles") or {}).get(role.value)),
            }
            for role, c in counts.items()
        },
        "conditions": conditions(phase, reason, message, previous, meta.get("generation"), now),
    }
    if last_scale is not None:
        status["lastScale"] = dict(last_scale)
    if served is not None:
        status["servedModelName"], status["servedRedis"] = served
    # None removes the field (a merge patch) once no pod serves an old name.
    status["retiringServedModelNames"] = list(retiring) or None
    return status


def refusal_status(
    meta: Body,
    why: str,
    previous: Body,
    now: str,
    reason: str = "InvalidSpec",
    phase: Phase = Phase.INVALID,
) -> dict[str, Any]:
    """The status of a refused spec (Invalid), or of writes the API server forbids
    (Degraded), with the reason; role counts left as they were."""
    message = why[:_MAX_MESSAGE]
    return {
        "observedGeneration": meta.get("generation"),
        "phase": phase.value,
        "reason": reason,
        "message": message,
        "conditions": conditions(phase, reason, message, previous, meta.get("generation"), now),
    }


def status_patch(previous: Body, new: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch from `previous` to `new`, or None when nothing changed.

    Fields `new` does not manage (lastScale between scalings) are kept; roles
    of another mode (after a mode change) are removed.
    """
    patch = dict(new)
    if "roles" in new:
        gone = {role: None for role in previous.get("roles") or {} if role not in new["roles"]}
        if gone:
            patch["roles"] = {**new["roles"], **gone}
    changed = any(previous.get(key) != value for key, value in patch.items() if key != "roles")
    changed = changed or ("roles" in patch and previous.get("roles") != new["roles"])
    return patch if changed else None


def conditions(
    phase: Phase, reason: str, message: str, previous: Body, generation: Any, now: str
) -> list[dict[str, Any]]:
    """Ready, Progressing, Degraded and Invalid, and kstatus' Reconciling and Stalled; a
    transition time moves only with the status.

    kstatus (Flux's health checks, kpt, `kubectl apply --prune` waits) reads only
    Reconciling and Stalled of a custom resource: without them a model crash-looping or
    refused read as reconciled. Stalled: what waits on someone (a refused spec, pods that
    cannot start); Reconciling: what the cluster is still bringing about, lost pods
    being replaced too."""
    before = {c.get("type"): c for c in previous.get("conditions") or []}
    replacing = phase is Phase.DEGRADED and reason == "ReplicasUnavailable"
    scaling = phase is Phase.READY and reason == "ScalingUp"  # serving, and changing
    holds = {
        ConditionType.READY: phase is Phase.READY,
        ConditionType.PROGRESSING: phase in (Phase.PENDING, Phase.PROGRESSING) or scaling,
        ConditionType.DEGRADED: phase is Phase.DEGRADED,
        ConditionType.INVALID: phase is Phase.INVALID,
        ConditionType.RECONCILING: phase in (Phase.PENDING, Phase.PROGRESSING)
        or replacing
        or scaling,
        ConditionType.STALLED: phase is Phase.INVALID
        or (phase is Phase.DEGRADED and not replacing),
    }
    result = []
    for kind, true in holds.items():
        status = "True" if true else "False"
        why, text = reason, message
        if kind is ConditionType.INVALID and not true:
            why, text = "SpecValid", "the spec passed the operator's checks"
        old = before.get(kind.value) or {}
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        result.append(
            {
                "type": kind.value,
                "status": status,
                "reason": why[:_MAX_REASON],
                "message": text[:_MAX_MESSAGE],
                "lastTransitionTime": since or now,
                "observedGeneration": generation,
            }
        )
    return result


def _summary(counts: Mapping[RoleName, RoleCounts]) -> str:
    """`normal 2/2 ready, ...`: pods past the desired count are said apart (a scale-down's
    pods stopping read "normal 4/1 ready")."""
    parts = []
    for role, c in counts.items():
        extra = c.ready - c.desired
        more = f" ({extra} more stopping)" if extra > 0 else ""
        parts.append(f"{role.value} {min(c.ready, c.desired)}/{c.desired} ready{more}")
    return ", ".join(parts)


def serving_floor(before: Body | None) -> int:
    """The pods a role served with when it last had every desired pod ready (status
    roles' `serving`; a status from before it: its desired count), 0 for a role new to
    the model. A scale-up that keeps them ready stays Ready; one of them lost degrades."""
    if not before:
        return 0
    if before.get("serving") is not None:
        return int(before["serving"])
    return int(before.get("desired") or 0)


def _serving(c: RoleCounts, before: Body | None) -> int:
    """The role's floor after this pass: its desired count once every pod is ready."""
    if c.ready >= c.desired and not c.rolling:
        return c.desired
    return serving_floor(before)


def _phase(counts: Mapping[RoleName, RoleCounts], previous: Body) -> tuple[Phase, str, str]:
    summary = _summary(counts)
    short = {role: c for role, c in counts.items() if c.ready < c.desired}
    rolling = [role.value for role, c in counts.items() if c.rolling]
    if not short and not rolling:
        return Phase.READY, "AllReplicasReady", summary
    # Short of ready pods, or rolling (new pods that fail while the old still serve).
    troubled = [
        (role, c.trouble)
        for role, c in counts.items()
        if c.trouble is not None and (c.ready < c.desired or c.rolling)
    ]
    for role, trouble in troubled:  # the pods' own words before the Deployment's
        if trouble.degrades:
            return Phase.DEGRADED, trouble.reason, f"{role.value}: {trouble.message}; {summary}"
    stalls = [(role, c.stall) for role, c in counts.items() if c.stall is not None]
    if stalls:
        role, stall = stalls[0]
        roles = ", ".join(r.value for r, _ in stalls)
        why = f"{role.value}: {stall.message}; " if stall.message else ""
        return Phase.DEGRADED, stall.reason, f"{roles} cannot progress: {why}{summary}"
    reported = previous.get("roles") or {}
    # Only Ready, or pods lost since, says it served: a new model whose engines crashed,
    # or that waited on a quota or a slow download past its deadline, is not one that
    # lost pods once that is over (it is starting).
    was_serving = previous.get("phase") == Phase.READY.value or (
        previous.get("phase") == Phase.DEGRADED.value
        and previous.get("reason") == "ReplicasUnavailable"
    )
    floors = {role: serving_floor(reported.get(role.value)) for role in counts}
    if (
        was_serving
        and not rolling
        and all(
            role.value in reported and c.desired > floors[role] and c.ready >= max(1, floors[role])
            for role, c in short.items()
        )
    ):
        waiting = "".join(f"{r.value}: {t.message}; " for r, t in troubled)
        return Phase.READY, "ScalingUp", f"scaling up: {waiting}{summary}"
    # A pod it served with is not ready: fewer than its floor, or than it wants now.
    lost = [
        role.value
        for role, c in short.items()
        if was_serving and not c.rolling and c.ready < min(c.desired, floors[role])
    ]
    if lost:
        # The replacements' trouble (no node can take them) is what to do about it.
        why = "".join(f"{r.value}: {t.message}; " for r, t in troubled if r.value in lost)
        message = f"{', '.join(lost)} lost pods: {why}{summary}"
        return Phase.DEGRADED, "ReplicasUnavailable", message
    if troubled:  # a pod no node can take yet: waiting, with the scheduler's reason
        role, trouble = troubled[0]
        phase = Phase.PROGRESSING if any(c.ready for c in counts.values()) else Phase.PENDING
        return phase, trouble.reason, f"{role.value}: {trouble.message}; {summary}"
    if not any(c.ready for c in counts.values()):
        return Phase.PENDING, "PodsStarting", f"no engine pod ready yet: {summary}"
    if rolling:
        return Phase.PROGRESSING, "RollingOut", f"{', '.join(rolling)} rolling out: {summary}"
    return Phase.PROGRESSING, "PodsStarting", summary
