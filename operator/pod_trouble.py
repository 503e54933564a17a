"""Why a role's engine pods are not ready, read from the pods' own status.

A Deployment's counts say "0/2 ready" whatever the cause; the pods say why: an
engine that exits at start (a model path that is not there, a KV cache too small
for one sequence), one killed for memory, an image that cannot be pulled, a pod
no node can take. The status quotes it, so `kubectl get md` answers what
`kubectl describe pod` and `kubectl logs --previous` would.

The engine and fetch-model containers set terminationMessagePolicy
FallbackToLogsOnError, so a crash's last log lines (the engine's one-line
`tandem: error: ...`) are in lastState.terminated.message.

Pure functions of pod objects, as the API server returns them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.operator.engine_flags import ENGINE_CONTAINER
from tandem.redaction import redacted

Body = Mapping[str, Any]

# Of a crash's log tail, the lines quoted: the error is the last of them.
_QUOTED_LINES = 3
_QUOTED_CHARS = 600
# Waiting reasons that do not pass by themselves (ContainerCreating and
# PodInitializing do).
_PULL = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ImageInspectError",
        "ErrImageNeverPull",
    }
)
_CONFIG = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
# Restarts after which a container that failed last time and is not ready is in a
# crash loop, between its back-offs too (running again, not ready yet): its trouble
# holds through the cycle instead of coming and going with each restart.
_LOOPING_RESTARTS = 2


@dataclass(frozen=True)
class PodTrouble:
    """What keeps a pod from serving."""

    # The status reason: EngineCrashLoop, EngineOOMKilled,
    # ModelFetchFailing, ModelFetchOOMKilled (the fetch-model init container),
    # ImagePullFailing, ContainerConfigError, or Unschedulable.
    reason: str
    # For people: the pod, what happened, and its own words.
    message: str

    @property
    def degrades(self) -> bool:
        """It will not pass by itself. An unschedulable pod may (a node autoscaler
        adds a node); the others need the spec, the image or the cluster fixed."""
        return self.reason != "Unschedulable"


def role_trouble(pods: Sequence[Body]) -> PodTrouble | None:
    """The trouble of the first (by name) of a role's pods that has one; None if none."""
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        trouble = pod_trouble(pod)
        if trouble is not None:
            return trouble
    return None


def pod_trouble(pod: Body) -> PodTrouble | None:
    """Why `pod` cannot serve, or None when nothing says it will not (starting, ready)."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None  # on its way out: its troubles are over
    if status.get("phase") in ("Failed", "Succeeded"):
        # Ended for good (evicted, its node shut down): the ReplicaSet made another in
        # its place, and the ended one lingers until the garbage collector's threshold.
        return None
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            why = condition.get("message") or "no node can take it"
            return PodTrouble("Unschedulable", f"pod {name} cannot be scheduled: {why}")
    # Init containers (fetch-model) run first: while one fails, the engine waits.
    for init in status.get("initContainerStatuses") or []:
        if ((init.get("state") or {}).get("terminated") or {}).get("exitCode") == 0:
            continue  # done: the failures before it (a download retried) are history
        trouble = _container_trouble(name, init, _init_container(init.get("name", "?")))
        if trouble is not None:
            return trouble
    engine = next(
        (
            c
            for c in status.get("containerStatuses") or []
            if c.get("name") == ENGINE_CONTAINER and not c.get("ready")
        ),
        None,
    )
    return None if engine is None else _container_trouble(name, engine, _ENGINE)


@dataclass(frozen=True)
class _Container:
    """How the status names a container's troubles."""

    what: str  # in a message
    crashes: str  # the reason when it keeps exiting
    oom: str  # the reason when it is killed for memory
    oom_advice: str
    # Its startupProbe passed since its last restart once `started` is true (without
    # one, Kubernetes sets it as the container starts: no proof of anything).
    has_startup_probe: bool = False


_ENGINE = _Container(
    "the engine",
    "EngineCrashLoop",
    "EngineOOMKilled",
    "raise the role's resources.limits.memory, or lower engine.kvCacheMemory or engine.maxNumSeqs",
    has_startup_probe=True,
)


def _init_container(name: str) -> _Container:
    return _Container(
        f"init container {name}", "ModelFetchFailing", "ModelFetchOOMKilled", "see its logs"
    )


def _container_trouble(pod: str, container: Body, kind: _Container) -> PodTrouble | None:
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    if reason in _PULL:
        image = container.get("image", "the image")
        detail = waiting.get("message") or reason
        if reason == "ErrImageNeverPull":
            detail = f"imagePullPolicy is Never and the node does not have it ({detail})"
        return PodTrouble("ImagePullFailing", f"pod {pod}: {image} cannot be pulled: {detail}")
    if reason in _CONFIG:
        detail = waiting.get("message") or reason
        return PodTrouble("ContainerConfigError", f"pod {pod}: {kind.what} cannot start: {detail}")
    last = (container.get("lastState") or {}).get("terminated") or {}
    restarts = container.get("restartCount", 0)
    failed = bool(last) and last.get("exitCode") != 0
    if not (reason == "CrashLoopBackOff" and last) and not (
        failed and restarts >= _LOOPING_RESTARTS
    ):
        return None  # starting, or exited once and restarting: not a loop yet
    running = (container.get("state") or {}).get("running") is not None
    if kind.has_startup_probe and running and container.get("started"):
        # Up since its last exit (its startup probe passed): that exit, maybe hours
        # old, is no cause of its being unready now (a Redis blip read as a crash loop,
        # quoting the old log).
        return None
    if last.get("reason") == "OOMKilled":
        return PodTrouble(
            kind.oom,
            f"pod {pod}: {kind.what} was killed for using more memory than its limit "
            f"({restarts} restarts): {kind.oom_advice}",
        )
    said = _tail(last.get("message") or "")
    words = f": {said}" if said else " (no message: see kubectl logs --previous)"
    return PodTrouble(
        kind.crashes,
        f"pod {pod}: {kind.what} exits with code {last.get('exitCode', '?')} "
        f"({restarts} restarts){words}",
    )


def _tail(text: str) -> str:
    """The last lines of a log tail, where a fatal error is."""
    # Quoted in the model's status, which more people read than the pod's log.
    lines = [redacted(line.strip()) for line in text.strip().splitlines() if line.strip()]
    quoted = " | ".join(lines[-_QUOTED_LINES:])
    return quoted if len(quoted) <= _QUOTED_CHARS else "..." + quoted[-_QUOTED_CHARS:]
