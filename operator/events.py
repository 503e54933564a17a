"""The Events of a reconciliation pass: what it changed and who caused it (`kubectl describe`).

Pure. The reason names the cause: the autoscaler or a bound (ScaledUp,
ScaledDown), a spec edit (SpecApplied), the operator's own settings
(SettingsApplied), a hand edit set back (DriftRepaired), a spec that cannot be
served (InvalidSpec, ServedNameTaken, ChildTaken: once, not on every pass), writes the
API server forbids (Forbidden), a role whose metrics nobody can read (MetricsUnreadable,
then MetricsReadable: once each), a request queue nobody can read (QueueUnreadable,
then QueueReadable); a pass that failed (ReconcileFailed) is the Controller's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.operator.autoscaler import Decision
from tandem.operator.drift import OWNED_KEYS_ANNOTATION, ChildPatch
from tandem.operator.manifests import SPEC_REPLICAS_ANNOTATION, child_name
from tandem.operator.role_name import RoleName
from tandem.operator.setting_changes import SettingChange
from tandem.operator.status import Scale
from tandem.operator.status_model import Phase
from tandem.redaction import redacted

Body = Mapping[str, Any]

# The operator's records of what it wrote: a change of one is bookkeeping, not news
# (the change it records is reported).
_RECORDS = frozenset(
    f"metadata.annotations.{key}" for key in (OWNED_KEYS_ANNOTATION, SPEC_REPLICAS_ANNOTATION)
)


@dataclass(frozen=True)
class Event:
    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class Clamp:
    """A Deployment's count outside its role's bounds, set to the nearest bound."""

    role: RoleName
    found: int
    replicas: int
    # Not the count the operator last reported: the Deployment was scaled by hand.
    by_hand: bool

    @property
    def bound(self) -> str:
        side = "above maxReplicas" if self.found > self.replicas else "below minReplicas"
        return f"{side} {self.replicas}"

    @property
    def scale(self) -> Scale:
        """The clamp as a scaling of the role, reported like the autoscaler's."""
        reason = f"{self.role.value} scale {self.found}->{self.replicas}: {self.bound}"
        return Scale(self.role, self.found, self.replicas, reason)


def events(
    model: Body,
    creates: Sequence[Body],
    patches: Sequence[ChildPatch],
    deletes: Sequence[str],
    scales: Sequence[Scale],
    hand_scaled: Sequence[Clamp],
    by_setting: Sequence[SettingChange],
) -> tuple[Event, ...]:
    """The Events of a pass of a valid spec that makes these changes.

    `deletes` are "Kind name"; `by_setting` the changes the operator's own settings
    make (setting_changes.py).
    """
    meta, previous = model["metadata"], model.get("status") or {}
    found = [Event(s.event_reason, s.reason) for s in scales]
    if "observedGeneration" not in previous:
        return tuple(found)  # the first pass: creating the children is not news
    name = meta["name"]
    # A scaled role's count is in its Scaled Event; a hand scale set back says what it was.
    replicas: dict[str, str | None] = {
        f"Deployment {child_name(name, s.role)}": None for s in scales
    }
    for clamp in hand_scaled:
        note = f"spec.replicas ({clamp.found}, {clamp.bound})"
        replicas[f"Deployment {child_name(name, clamp.role)}"] = note
    setting, other, settings = [], [], set()
    for patch in patches:
        child = f"{patch.kind} {patch.name}"
        ours, rest = [], []
        for path in patch.drift:
            if path in _RECORDS:
                continue
            causes = {c.setting for c in by_setting if c.covers(child, path)}
            settings |= causes
            if causes:
                ours.append(path)
            elif path == "spec.replicas":
                rest.append(replicas.get(child, path))
            else:
                rest.append(path)
        setting += [f"{child}: {', '.join(ours)}"] if ours else []
        rest = [path for path in rest if path]
        other += [f"{child}: {', '.join(rest)}"] if rest else []
    if setting:
        flags = " and ".join(sorted(settings))
        why = f"the operator's {flags} changed, so the engine pods roll: "
        found.append(Event("SettingsApplied", why + "; ".join(setting)))
    # Nothing was applied while Invalid, or while the API server forbade the writes (a
    # quota): what changes now is the spec's, edited or not (a child the API server now
    # accepts, a served name now free).
    applying = (
        previous["observedGeneration"] != meta.get("generation")
        or previous.get("phase") == Phase.INVALID.value
        or previous.get("reason") == "Forbidden"
    )
    made = "created" if applying else "recreated"
    other += [f"{c['kind']} {c['metadata']['name']}: {made}" for c in creates]
    # A child the spec no longer has goes because of the spec, in the pass that edits it
    # or a later one (a mode change's old role, once the new roles serve).
    gone = [f"{child}: deleted" for child in deletes]
    if applying:
        other, gone = other + gone, []
    if other:
        found.append(Event("SpecApplied" if applying else "DriftRepaired", "; ".join(other)))
    if gone:
        found.append(Event("SpecApplied", "; ".join(gone)))
    return tuple(found)


def with_adoptions(events: Sequence[Event], adopted: Collection[str]) -> tuple[Event, ...]:
    """The pass's events once its writes are made: a child planned as created but found
    already there and taken over ("Deployment m-decode", its labels removed by hand or
    left by an earlier ModelDeployment of the same name) is said to be adopted, not
    (re)created, which is all the plan could know. On a first pass, whose creations
    are no news, an adoption is said all the same: an object that was there before."""
    if not adopted:
        return tuple(events)
    made = {
        f"{child}: {verb}": f"{child}: adopted"
        for child in adopted
        for verb in ("created", "recreated")
    }
    said = [
        Event(
            e.reason, "; ".join(made.get(part, part) for part in e.message.split("; ")), e.warning
        )
        for e in events
    ]
    told = {part for e in said for part in e.message.split("; ")}
    unsaid = [f"{child}: adopted" for child in sorted(adopted) if f"{child}: adopted" not in told]
    if unsaid:
        said.append(Event("DriftRepaired", "; ".join(unsaid)))
    return tuple(said)


def readability_events(decisions: Mapping[RoleName, Decision]) -> tuple[Event, ...]:
    """When a role's pods all became unreadable (the autoscaler holds it blind: a
    NetworkPolicy on port 8100, engines that hang) or readable again; once, not on
    every pass."""
    found = []
    for role, decision in decisions.items():
        if not decision.unreadable_changed:
            continue
        if decision.unreadable is not None:
            message = (
                f"{role.value}: {decision.unreadable}; autoscaling holds this role until "
                "one is (check that the operator reaches the engines' port 8100)"
            )
            found.append(Event("MetricsUnreadable", message, warning=True))
        else:
            found.append(Event("MetricsReadable", f"{role.value}: pods' metrics readable again"))
    return tuple(found)


def queue_events(before: str | None, now: str | None) -> tuple[Event, ...]:
    """When the request queue became unreadable (a Redis URL that resolves differently in
    the operator's namespace, a Redis down) or readable again; once, not on every pass."""
    if (before is None) == (now is None):
        return ()
    if now is not None:
        why = redacted(now)  # a URL's password never goes in an Event
        message = (
            f"autoscaling paused: the request queue is unreadable ({why}); check spec.redis "
            "(or the operator's own Redis where the spec names none) from the operator's "
            "namespace"
        )
        return (Event("QueueUnreadable", message, warning=True),)
    return (Event("QueueReadable", "the request queue is readable again: autoscaling resumed"),)


def refusal_event(previous: Body, status: Body) -> tuple[Event, ...]:
    """A Warning when the model is refused, or refused for another reason; not on every pass."""
    keys = ("phase", "reason", "message")
    if all(previous.get(key) == status.get(key) for key in keys):
        return ()
    return (Event(status["reason"], status["message"], warning=True),)
