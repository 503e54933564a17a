"""RoleName: the roles of a ModelDeployment, and the engine role each one's pods run.

One enum for the spec (a role's key under spec and status.roles), the
autoscaler (each role sized on its own signals) and the simulator. The engines
name their roles otherwise (tandem.protocol.Role: `tandem engine --role`);
`engine_role` and `of_engine` are the one mapping between the two. Imports no
Kubernetes or pydantic type, so the autoscaler stays independent of the CRD.
"""

from __future__ import annotations

from enum import StrEnum

from tandem.protocol import Role


class RoleName(StrEnum):
    """A role's key under spec (and status.roles), and the engine role its pods run."""

    NORMAL = "normal"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def engine_role(self) -> Role:
        """`tandem engine --role`: prefill pods are PROMPT engines, decode pods COMPLETION."""
        return _ENGINE_ROLES[self]

    @classmethod
    def of_engine(cls, role: Role | str) -> RoleName:
        """The role whose pods run engines of `role` (the `role` label on their metrics)."""
        return _OF_ENGINE[Role(role)]


_ENGINE_ROLES = {
    RoleName.NORMAL: Role.NORMAL,
    RoleName.PREFILL: Role.PROMPT,
    RoleName.DECODE: Role.COMPLETION,
}
_OF_ENGINE = {engine: name for name, engine in _ENGINE_ROLES.items()}
