"""Deployment: the roles a simulated cluster runs, with their engine configs and policies.

Built from command-line style arguments (mode, replicas and bounds per role)
or from a ModelDeployment YAML through the operator's own validation
(tandem.operator.validation.validate_spec), its EngineConfig per role
(validation.engine_config) and its scaling policy per role (scaling.policy),
so a YAML the operator refuses is refused here with the same reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem import strict_yaml
from tandem.engine.config import EngineConfig
from tandem.operator.quantity import quantity_bytes, quantity_value
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import RoleSpec
from tandem.operator.scaling import policy as role_policy
from tandem.operator.scaling_policy import ScalingPolicy
from tandem.operator.validation import engine_config, validate_spec
from tandem.sim.arguments import REPLICA_FLAGS

# Simulated prompts carry no content, so the prefix cache could only miss: it is
# turned off, which skips hashing every block (the biggest per-prompt cost).
_NO_PREFIX_CACHE = {"enable_prefix_caching": False}


@dataclass(frozen=True)
class RoleSetup:
    """One role of the cluster."""

    role: RoleName
    # The EngineConfig of every rank of every pod of the role.
    engine: EngineConfig
    # Bounds, targets and damping of the real autoscaler for this role.
    policy: ScalingPolicy
    # Pods at t = 0 (ready at once).
    replicas: int
    # Devices one rank spans with tensor parallelism.
    tp: int = 1
    # A rank's KV pool in bytes (the spec's engine.kvCacheMemory); None: what the devices
    # hold after the weights.
    kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.policy.min_replicas <= self.replicas <= self.policy.max_replicas:
            raise ValueError(
                f"{self.role}: replicas {self.replicas} is outside "
                f"[{self.policy.min_replicas}, {self.policy.max_replicas}]"
            )
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"--tp must be an integer >= 1, got {self.tp!r}")
        if self.engine.engine_type is not self.role.engine_role:
            raise ValueError(f"{self.role} pods run {self.role.engine_role} engines")

    @property
    def dp(self) -> int:
        """Data-parallel ranks per pod (they vote on each step's type)."""
        return self.engine.data_parallel_size

    @property
    def gpus_per_pod(self) -> int:
        return self.tp * self.dp

    @property
    def autoscaled(self) -> bool:
        return self.policy.min_replicas < self.policy.max_replicas


@dataclass(frozen=True)
class Deployment:
    roles: Mapping[RoleName, RoleSetup]

    def __post_init__(self) -> None:
        names = set(self.roles)
        if names not in ({RoleName.NORMAL}, {RoleName.PREFILL, RoleName.DECODE}):
            raise ValueError(
                "a deployment is either one normal role or a prefill and a decode role, "
                f"got {sorted(names)}"
            )

    @property
    def mode(self) -> str:
        return "normal" if RoleName.NORMAL in self.roles else "disaggregated"

    @property
    def autoscaled(self) -> bool:
        return any(r.autoscaled for r in self.roles.values())


def role_setup(
    role: RoleName | str,
    *,
    replicas: int = 1,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    tp: int = 1,
    engine: Mapping[str, object] | None = None,
    policy: Mapping[str, object] | None = None,
) -> RoleSetup:
    """A role from plain values: bounds default to a fixed count of `replicas`.

    Bad counts are refused naming `tandem sim`'s flags for the role (REPLICA_FLAGS)."""
    role = RoleName(role)
    config = EngineConfig(
        **{**_defaults(), **(engine or {}), **_NO_PREFIX_CACHE, "engine_type": role.engine_role}
    )
    bounds = _bounds(role, replicas, min_replicas, max_replicas)
    rules = {**bounds, **(policy or {}), "cache_prefill_watermark": config.cache_prefill_watermark}
    return RoleSetup(role, config, ScalingPolicy(**rules), replicas, tp)


# The most pods of a role a run simulates: each is a real scheduler with its block pool
# (--replicas 100000000 ran out of memory and was killed, saying nothing).
MOST_PODS = 100_000


def _bounds(role: RoleName, replicas: int, low: int | None, high: int | None) -> dict:
    flags = REPLICA_FLAGS[role]
    for flag, value in zip(flags, (replicas, low, high), strict=True):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MOST_PODS
        ):
            raise ValueError(f"{flag} must be an integer in 0..{MOST_PODS:,}, got {value!r}")
    count, fewest, most = flags
    low = replicas if low is None else low
    if high is None:
        high = replicas
        if high < 1:
            raise ValueError(f"{count} 0 needs {most} >= 1: {role} pods the autoscaler may start")
    elif high < 1:
        raise ValueError(f"{most} must be >= 1, got {high}")
    if not low <= replicas <= high:
        raise ValueError(
            f"{count} {replicas} must be within {fewest} {low} and {most} {high} (both default "
            f"to {count})"
        )
    return {"min_replicas": low, "max_replicas": high}


def _defaults() -> dict[str, object]:
    # Long enough for the studies' 4k-token prompts plus their outputs.
    return {"max_model_len": 8192}


def normal(replicas: int, tp: int = 1, **kwargs: object) -> Deployment:
    return Deployment({RoleName.NORMAL: role_setup("normal", replicas=replicas, tp=tp, **kwargs)})


def disaggregated(
    prefill: int, decode: int, tp: int = 1, engine: Mapping[str, object] | None = None
) -> Deployment:
    return Deployment(
        {
            RoleName.PREFILL: role_setup("prefill", replicas=prefill, tp=tp, engine=engine),
            RoleName.DECODE: role_setup("decode", replicas=decode, tp=tp, engine=engine),
        }
    )


def from_yaml(
    path: str | Path, tp: int = 1, vocab_size: int | None = None, *, on_gpu: bool = True
) -> Deployment:
    """The roles of a ModelDeployment manifest, validated as the operator validates it."""
    path = Path(path)
    try:
        manifest = strict_yaml.load(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "ModelDeployment":
        raise ValueError(f"{path}: expected a document of kind ModelDeployment")
    name = (manifest.get("metadata") or {}).get("name") or "sim"
    spec = validate_spec(manifest.get("spec"), name=name)
    roles = {}
    for role_name, role in spec.roles().items():
        config = engine_config(spec.engine, role_name, role)
        if spec.engine.max_model_len is None:  # the model's length: the simulator's default
            # The budget was derived from a stand-in length: derive it again.
            budget = spec.engine.max_num_batched_tokens
            config = dataclasses.replace(config, **_defaults(), max_num_batched_tokens=budget)
        # Speculation needs the vocabulary for its draft placeholders (the model's).
        config = dataclasses.replace(config, **_NO_PREFIX_CACHE, vocab_size=vocab_size)
        _check_gpus(path, role_name, role, tp * config.data_parallel_size, on_gpu)
        kv_bytes = spec.engine.kv_cache_memory
        roles[role_name] = RoleSetup(
            role_name,
            config,
            role_policy(role, watermark=spec.engine.cache_prefill_watermark),
            role.initial_replicas,
            tp,
            None if kv_bytes is None else quantity_bytes(kv_bytes),
        )
    return Deployment(roles)


def _check_gpus(
    path: Path, role_name: RoleName, role: RoleSpec, simulated: int, on_gpu: bool
) -> None:
    """ValueError when a role's pods ask for other GPUs than the run simulates (tp x
    dp), or for CPUs alone on a GPU device: the answer would be about another
    deployment."""
    limits = (role.resources.limits or {}) if role.resources is not None else {}
    asked = [int(quantity_value(v)) for k, v in limits.items() if k.endswith("/gpu")]
    if not asked and on_gpu and "cpu" in limits:
        raise ValueError(
            f"{path}: spec.{role_name} pods ask for CPUs and no GPU, the run simulates "
            "GPUs: give --device cpu, or the pods a GPU limit"
        )
    if asked and asked[0] != simulated:
        raise ValueError(
            f"{path}: spec.{role_name} pods ask for {asked[0]} GPUs, the run simulates "
            f"{simulated} a pod (--tp x dataParallelSize): give the --tp that matches"
        )
