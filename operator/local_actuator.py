"""The second actuator: one ModelDeployment as engine processes on this machine.

`tandem up -f model.yaml` runs this where the Kubernetes operator would run
pods: the same spec validation, the same engine flags, the same pure
autoscaler, with `tandem engine` processes in place of pods. Scale-up starts
processes; scale-down sends SIGTERM to the least-loaded ones, which drain
(finish what they run) and exit, exactly as pods do.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from pydantic.alias_generators import to_camel

from tandem import catalog
from tandem.backlog import queue_depth
from tandem.child import MAX_BACKOFF_S, Child, engine_child, engine_threads
from tandem.keys import Keys
from tandem.operator.autoscaler import Decision, RoleObservation, ScalingHistory, decide_all
from tandem.operator.engine_flags import cpu_threads, engine_arguments, engine_flags
from tandem.operator.engine_metrics import scrape
from tandem.operator.pod_load import PodSample, pod_load
from tandem.operator.role_name import RoleName
from tandem.operator.scaling import plan_resize
from tandem.operator.scaling import policy as scaling_policy
from tandem.operator.sources import sample_ranks
from tandem.operator.spec import GROUP, KIND, VERSION, ModelDeploymentSpec
from tandem.operator.validation import validate_spec
from tandem.redis_server import free_port

log = logging.getLogger("tandem.local")


@dataclass
class EngineProcess:
    """One engine of a role, like one pod."""

    role: RoleName
    child: Child
    http_port: int
    draining: bool = False
    # The last sample read, kept through a failed scrape for the next rate, and whether
    # the latest scrape read it: a scale-down stops the engines unread now first.
    last_sample: PodSample | None = None
    read_now: bool = False
    started_at: float = field(default_factory=time.monotonic)
    ranks: int = 1  # data-parallel ranks: rank r serves HTTP on http_port + r

    @property
    def name(self) -> str:
        return self.child.name

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def sample(self, client: httpx.AsyncClient) -> PodSample | None:
        """Every rank's metrics as one sample, as the operator reads a pod's; None if a
        rank cannot be read."""
        urls = [f"http://127.0.0.1:{self.http_port + r}" for r in range(self.ranks)]
        return await sample_ranks(lambda url: scrape(client, url, self.name), urls)


API_VERSION = f"{GROUP}/{VERSION}"
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
# What a ModelDeployment document may hold besides its spec: the fields the API server
# takes (a manifest exported with `kubectl get -o yaml` has metadata's server fields,
# and a status). Anything else kubectl would refuse, so -f refuses it too.
_TOP_LEVEL = {"apiVersion", "kind", "metadata", "spec", "status"}
_METADATA = {
    "name", "namespace", "labels", "annotations", "generateName", "uid", "resourceVersion",
    "generation", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds",
    "finalizers", "ownerReferences", "managedFields", "selfLink",
}  # fmt: skip


def load_manifest(manifest: dict[str, Any]) -> tuple[str, ModelDeploymentSpec]:
    """(name, validated spec) of a ModelDeployment document; InvalidSpec explains a bad one."""
    if manifest.get("kind") != KIND:
        raise ValueError(f"expected kind {KIND}, got {manifest.get('kind')!r}")
    if manifest.get("apiVersion") != API_VERSION:
        raise ValueError(f"apiVersion must be {API_VERSION}, got {manifest.get('apiVersion')!r}")
    if unknown := sorted(set(manifest) - _TOP_LEVEL):
        raise ValueError(
            f"{unknown[0]}: unknown field (a ModelDeployment has {_listed(_TOP_LEVEL)})"
        )
    metadata = manifest.get("metadata")
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a mapping with a name, got {metadata!r}")
    if unknown := sorted(set(metadata) - _METADATA):
        raise ValueError(f"metadata.{unknown[0]}: unknown field")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"metadata.name must be a non-empty string, got {name!r}")
    spec = validate_spec(manifest.get("spec"), name=name)
    if spec.model.pvc is not None or spec.model.hugging_face is not None:
        raise ValueError(
            "on one machine the model must be spec.model.path (a local directory, a .gguf "
            "file, or an alias such as smollm2): PVCs and Hub downloads are cluster features "
            "(examples/local/smollm2.yaml is one that runs here)"
        )
    return name, spec


# The spec's fields of the pods' image, which one machine runs without.
_IMAGE_FIELDS = ("image", "image_pull_policy", "image_pull_secrets")


def cluster_only(spec: ModelDeploymentSpec) -> list[str]:
    """The fields a manifest sets that one machine has no use for (an image, where pods
    go, what they may take beyond a CPU limit that sizes an engine's threads): said,
    not silently run as something else. spec.redis is said apart (what is used instead)."""
    unused = [f"spec.{to_camel(f)}" for f in _IMAGE_FIELDS if f in spec.model_fields_set]
    for role, role_spec in spec.roles().items():
        for name in ("node_selector", "tolerations", "affinity"):
            if getattr(role_spec, name):
                unused.append(f"spec.{role}.{to_camel(name)}")
        for kind in ("limits", "requests"):
            amounts = getattr(role_spec.resources, kind, None) or {}
            # A CPU limit sizes the threads, where no GPU limit beside it makes them torch's.
            sized = kind == "limits" and cpu_threads(role_spec) is not None
            used = {"cpu"} if sized else set()
            unused += [f"spec.{role}.resources.{kind}.{k}" for k in amounts if k not in used]
    return unused


def _listed(names: set[str]) -> str:
    return ", ".join(sorted(names))


class LocalActuator:
    def __init__(
        self,
        name: str,
        spec: ModelDeploymentSpec,
        *,
        redis_url: str,
        log_dir: Path,
        keys: Keys | None = None,
        extra_engine_args: tuple[str, ...] = (),
        say: Callable[[str], None] = log.info,
    ) -> None:
        self.name = name
        self.spec = spec
        # In every engine id: ids are unique among the live engines of a Redis, and two
        # stacks of one name on one Redis must not share them (one's drain deleted the
        # other's registry entry).
        self._run_id = secrets.token_hex(3)
        self.redis_url = redis_url
        self.log_dir = log_dir
        self.keys = keys or Keys()
        self.extra_engine_args = extra_engine_args
        self.say = say  # what `tandem up` prints: starts, exits, scales, holds
        self.model = spec.served_model_name(name)
        self.roles = spec.roles()
        watermark = spec.engine.cache_prefill_watermark
        self.policies = {r: scaling_policy(s, watermark=watermark) for r, s in self.roles.items()}
        self.replicas = {r: s.initial_replicas for r, s in self.roles.items()}
        # As the operator does for a role it sees first: the starting count counts as
        # recommended now in both windows, so nothing scales, down or up, before a
        # whole window of evidence.
        started = time.monotonic()
        self.histories = {r: ScalingHistory.starting(started, self.replicas[r]) for r in self.roles}
        self.engines: dict[RoleName, list[EngineProcess]] = {r: [] for r in self.roles}
        self.decisions: list[Decision] = []  # every change, for tests
        # Each role's last hold said (its reason): a hold is said once, not every evaluation.
        self._holds: dict[RoleName, str] = {}
        self._serial = 0
        self._redis = redis.Redis.from_url(redis_url)
        # A role's engines that could not be started (no fork, a log file refused): how
        # many tries failed in a row, and when to try again.
        self._failed_starts: dict[RoleName, int] = {}
        self._retry_at: dict[RoleName, float] = {}

    # ------------------------------------------------------------ processes

    def start(self) -> list[Child]:
        if unused := cluster_only(self.spec):
            self.say(f"cluster    not used on one machine: {', '.join(unused)}")
        self._declare()
        for role, count in self.replicas.items():
            for _ in range(count):
                self._spawn(role)
        return self.children()

    def children(self) -> list[Child]:
        """The engines' processes, every role."""
        return [e.child for engines in self.engines.values() for e in engines]

    def _spawn(self, role: RoleName) -> EngineProcess:
        self._serial += 1
        flags = engine_flags(self.name, self.spec, role, self.roles[role], self.keys.prefix)
        ranks = self.roles[role].data_parallel_size  # rank r listens on port + r
        port = free_port(ranks)
        flags.update(host="127.0.0.1", port=str(port), **{"kv-port": str(free_port(ranks))})
        flags["engine-id"] = f"{self.name}-{role}-{self._run_id}-{self._serial}"
        # The cores are shared by as many engines as the roles may scale to. A pod's
        # CPU limit (its --threads) bounds an engine here too but shares nothing: on
        # one machine no quota holds it, and more threads than cores spin at barriers.
        most = sum(r.max_replicas * r.data_parallel_size for r in self.roles.values())
        if (share := engine_threads(most)) is not None:
            flags["threads"] = str(min(share, int(flags.get("threads", share))))
        child = engine_child(
            f"{role}-{self._serial}",
            [*engine_arguments(flags), *self.extra_engine_args],
            port,
            self.log_dir / f"engine-{role}-{self._serial}.log",
            self.redis_url,
            decodes=role is RoleName.DECODE,
        )
        child.start()
        engine = EngineProcess(role, child, port, ranks=ranks)
        self.engines[role].append(engine)
        self.say(f"{engine.name:<10} starting (log {child.log_path})")
        return engine

    def _start_missing(self, role: RoleName, now: float) -> None:
        """Start the engines the role's count asks for beyond those it has. One that
        cannot start is said and tried again after a backoff: it ended the whole stack,
        or left the role an engine short for good (its count said it had them all)."""
        missing = self.replicas[role] - len(self.active(role))
        if missing <= 0 or now < self._retry_at.get(role, 0.0):
            return
        try:
            for _ in range(missing):
                self._spawn(role)
        except OSError as exc:
            failed = self._failed_starts.get(role, 0)
            wait = min(MAX_BACKOFF_S, 2.0**failed)
            self._failed_starts[role], self._retry_at[role] = failed + 1, now + wait
            self.say(f"{role} engine could not start: {exc}; trying again in {wait:.0f}s")
        else:
            self._failed_starts.pop(role, None)

    def active(self, role: RoleName) -> list[EngineProcess]:
        return [e for e in self.engines[role] if not e.draining]

    def supervise(self) -> None:
        """Restart engines that hung or died, with backoff and under their own engine id
        (a pod's container restarts so); forget drained ones that exited."""
        now = time.monotonic()
        for role in self.roles:
            self._start_missing(role, now)
        for engines in self.engines.values():
            for engine in list(engines):
                if not engine.draining:
                    for line in engine.child.supervise(now):
                        self.say(line)
                    continue
                if engine.child.hung(now):
                    self.say(f"{engine.name} stopped answering while draining; killing it")
                    engine.child.kill()
                if not engine.child.alive:
                    self.say(f"{engine.name:<10} drained and stopped")
                    engines.remove(engine)

    def close(self) -> None:
        """Let go of Redis. The stack stops the engines (`children()`), in order."""
        self._redis.close()

    # ---------------------------------------------------------- autoscaling

    def evaluate(
        self, now: float | None = None, *, stopping: bool = False
    ) -> dict[RoleName, Decision]:
        """Scrape, decide, act: one evaluation of every role. `stopping` (the stack
        answers what it admitted, then stops): only a role at zero is started, for
        requests no engine could answer; more engines, each a model's load, would be
        drained as soon as they were up."""
        now = time.monotonic() if now is None else now
        observed = asyncio.run(self._observe())
        self._declare()
        queue = queue_depth(self._redis, self.keys, self.model)
        decisions = decide_all(observed, queue, self.policies, self.histories, now)
        for role, decision in decisions.items():
            self.histories[role] = decision.history
            if decision.changed and not (stopping and decision.current > 0):
                self._resize(role, decision)
            if not stopping:
                self._say_hold(role, decision)
        return decisions

    def _say_hold(self, role: RoleName, decision: Decision) -> None:
        """Say once why a role keeps its count while its signals ask for another."""
        if decision.changed or decision.recommendation == decision.current:
            self._holds.pop(role, None)
            return
        # Its numbers (time left in a window, a signal's value) change every evaluation:
        # the same hold is the same words.
        kind = _NUMBER.sub("#", decision.reason)
        if self._holds.get(role) != kind:
            self._holds[role] = kind
            self.say(f"hold {decision.reason} (the signals ask for {decision.recommendation})")

    def _declare(self) -> None:
        """In the catalog, so that the gateway queues requests even while no engine runs."""
        owner = f"local/{self.name}"
        catalog.declare(self._redis, self.keys, self.model, owner, catalog.MIN_DECLARATION_TTL_S)

    async def _observe(self) -> dict[RoleName, RoleObservation]:
        # This machine's engines: no proxy from the environment applies.
        async with httpx.AsyncClient(trust_env=False) as client:
            observed = {}
            for role in self.roles:
                engines = self.active(role)
                samples = await asyncio.gather(*(e.sample(client) for e in engines))
                loads = []
                unreadable = 0
                for engine, sample in zip(engines, samples, strict=True):
                    engine.read_now = sample is not None
                    if sample is not None:
                        loads.append(pod_load(sample, engine.last_sample))
                        engine.last_sample = sample
                    elif engine.child.alive and engine.child.started_up:
                        # Up (it answers /healthz), as a ready pod is, but its metrics
                        # unread: counted as the operator counts it (scaling.evaluate), or
                        # a role whose scrapes all time out under load froze at its size.
                        unreadable += 1
                observed[role] = RoleObservation(self.replicas[role], tuple(loads), unreadable)
            return observed

    def _resize(self, role: RoleName, decision: Decision) -> None:
        self.say(decision.reason)
        self.decisions.append(decision)
        self.replicas[role] = decision.replicas
        active = self.active(role)
        # An engine that died, restarts or hangs is ranked by nothing (stopped first, as a
        # ReplicaSet removes pods not ready first): by its reading from before, it was
        # kept and the engine serving was stopped, leaving the role nothing until the
        # dead one came back. One answering its liveness probe whose scrape failed (busy)
        # is ranked by its last reading, as the operator ranks a ready pod unread.
        readings = [
            e.last_sample if e.child.alive and (e.read_now or e.child.answering) else None
            for e in active
        ]
        _, drain = plan_resize(decision.replicas, readings)
        self._start_missing(role, time.monotonic())
        for i in drain:  # the least loaded (what pod-deletion-cost does in a cluster)
            engine = active[i]
            engine.draining = True
            engine.child.signal(signal.SIGTERM)
            self.say(f"{engine.name:<10} draining (it finishes what it runs, then exits)")
