"""The ModelDeployment status: what the operator reports, in the shape the CRD declares.

The operator writes it (through the status subresource); the models here give
the CRD its status schema and the printer columns something to point at.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from tandem.operator.spec_base import SpecModel


class Phase(StrEnum):
    PENDING = "Pending"  # accepted, no pod ready yet
    PROGRESSING = "Progressing"  # pods starting, rolling or scaling
    READY = "Ready"  # every role has its desired pods ready
    DEGRADED = "Degraded"  # serving below what it should (crash loops, unschedulable pods)
    INVALID = "Invalid"  # the spec cannot work; the reason is in the Invalid condition


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    INVALID = "Invalid"
    # kstatus' (Flux, kpt, cli-utils): work under way; stuck until someone acts.
    RECONCILING = "Reconciling"
    STALLED = "Stalled"


class Condition(SpecModel):
    """One condition, in the Kubernetes metav1.Condition shape."""

    type: ConditionType = Field(
        strict=False,
        description="Ready, Progressing, Degraded, Invalid, Reconciling or Stalled.",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(
        None, max_length=1024, description="A CamelCase word for machines and columns."
    )
    message: str | None = Field(None, max_length=32768, description="Why, for people.")
    last_transition_time: str | None = Field(
        None,
        json_schema_extra={"format": "date-time"},
        description="When status last changed (RFC 3339).",
    )
    observed_generation: int | None = Field(
        None, ge=0, description="The metadata.generation this condition was computed from."
    )


class RoleStatus(SpecModel):
    """Pod counts of one role."""

    desired: int | None = Field(None, ge=0, description="Pods the autoscaler wants.")
    replicas: int | None = Field(None, ge=0, description="Pods that exist.")
    ready: int | None = Field(None, ge=0, description="Pods that pass /readyz.")
    serving: int | None = Field(
        None,
        ge=0,
        description="Pods the role served with when it last had every desired pod ready: "
        "a scale-up keeping them ready stays Ready, one of them lost is Degraded.",
    )


class RolesStatus(SpecModel):
    """Pod counts per role (only the roles of the spec's mode)."""

    normal: RoleStatus | None = None
    prefill: RoleStatus | None = None
    decode: RoleStatus | None = None


class ScaleEvent(SpecModel):
    """The last replica change the autoscaler made."""

    role: Literal["normal", "prefill", "decode"] = Field(description="The role scaled.")
    from_: int = Field(ge=0, alias="from", description="Pods before.")
    to: int = Field(ge=0, description="Pods after.")
    reason: str | None = Field(None, max_length=1024, description="Why, e.g. the metric.")
    time: str | None = Field(
        None, json_schema_extra={"format": "date-time"}, description="When (RFC 3339)."
    )


class ModelDeploymentStatus(SpecModel):
    """What the operator observed and did."""

    observed_generation: int | None = Field(
        None, ge=0, description="The metadata.generation the status describes."
    )
    phase: Phase | None = Field(
        None, strict=False, description="Summary: " + ", ".join(Phase) + "."
    )
    reason: str | None = Field(None, max_length=1024, description="Why the phase (a word).")
    message: str | None = Field(None, max_length=32768, description="Why the phase, for people.")
    roles: RolesStatus | None = Field(None, description="Pod counts per role.")
    conditions: list[Condition] | None = Field(
        None,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
        description="Ready, Progressing, Degraded, Invalid; Reconciling and Stalled for kstatus.",
    )
    last_scale: ScaleEvent | None = Field(None, description="The last scaling decision.")
    served_model_name: str | None = Field(
        None,
        max_length=253,
        description="The name the pods serve (the last applied spec's servedModelName): "
        "another ModelDeployment that claims it is refused while this one serves it.",
    )
    served_redis: str | None = Field(
        None,
        max_length=64,
        description="A digest of the Redis database the pods' queues are on (the last "
        "applied spec's): a ModelDeployment of another namespace that serves the same name "
        "on it is refused while this one serves it.",
    )
    retiring_served_model_names: list[Annotated[str, Field(max_length=253)]] | None = Field(
        None,
        description="Names pods from before a rename (or a mode change) still serve until "
        "the new pods replace them: held against other ModelDeployments meanwhile.",
    )
