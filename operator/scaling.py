"""Pure glue between a ModelDeployment and the autoscaler: policies, observations, costs.

autoscaler.py decides from numbers; this module turns Kubernetes objects into
those numbers and the decisions back into what the operator writes: the
scaling policy of a role spec, which pods to scrape, the observation of a
role and the pod-deletion costs before a scale-down (status.lastScale is
status.Scale's). No I/O (logging aside): the controller scrapes and writes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.operator.autoscaler import Decision, RoleObservation, ScalingHistory, decide_all
from tandem.operator.engine_flags import ENGINE_CONTAINER, HTTP_PORT
from tandem.operator.manifests import (
    COMPONENT_LABEL,
    DELETION_COST_ANNOTATION,
    INSTANCE_LABEL,
    pods_of,
    selector_labels,
)
from tandem.operator.pod_load import SCRAPE_LOG, PodSample, pod_load
from tandem.operator.role_name import RoleName
from tandem.operator.role_spec import DecodeRole, NormalRole, PrefillRole, RoleSpec
from tandem.operator.scaling_policy import ScalingPolicy
from tandem.operator.spec import ModelDeploymentSpec
from tandem.queue_state import QueueState

log = logging.getLogger(__name__)

Body = Mapping[str, Any]


@dataclass(frozen=True)
class ScalerMemory:
    """What one evaluation of a ModelDeployment leaves for the next (kept in memory only)."""

    histories: Mapping[RoleName, ScalingHistory] = field(default_factory=dict)
    # The last sample of each pod: rates (budget utilisation) need two.
    samples: Mapping[str, PodSample] = field(default_factory=dict)
    # What each role's history watched: its Deployment's uid, at the count the last
    # edit of spec.<role>.replicas set (controller._watched_as).
    deployments: Mapping[RoleName, str] = field(default_factory=dict)
    # Why the last evaluation could not read the request queue; None once it could
    # (an Event says each change once, events.queue_events).
    queue_unreadable: str | None = None
    # When the pass that left it ended (the controller's real clock, not the
    # autoscaler's): a memory much older was not kept up (Controller.reconcile).
    watched_at: float | None = None
    # Since when (the autoscaler's clock) the queue could not be read, in a stretch
    # short enough to keep the memory: that time is no idle time (evaluate).
    queue_unread_since: float | None = None

    def watching(self, deployments: Mapping[RoleName, str]) -> ScalerMemory:
        """This memory for the roles' Deployments now: a role whose Deployment is new (a
        mode changed away and back, a Deployment deleted and made again), or whose count
        an edit set, has no past, however quickly that happened."""
        kept = {
            role: history
            for role, history in self.histories.items()
            if role in deployments and self.deployments.get(role) == deployments[role]
        }
        return dataclasses.replace(self, histories=kept, deployments=dict(deployments))

    def queue_unread(self, why: str, now: float) -> ScalerMemory:
        """This memory after an evaluation skipped for want of the queue (`why`): kept,
        as old as the last evaluation (its watched_at), the unread stretch noted."""
        since = self.queue_unread_since if self.queue_unread_since is not None else now
        return dataclasses.replace(self, queue_unreadable=why, queue_unread_since=since)


@dataclass(frozen=True)
class Evaluation:
    decisions: Mapping[RoleName, Decision]
    memory: ScalerMemory

    @property
    def changed(self) -> dict[RoleName, Decision]:
        return {role: d for role, d in self.decisions.items() if d.changed}


def policy(role: RoleSpec, *, watermark: float) -> ScalingPolicy:
    """The CRD's scaling fields of one role, as the autoscaler's policy; `watermark`:
    the spec's engine.cachePrefillWatermark."""
    fields: dict[str, Any] = {
        "cache_prefill_watermark": watermark,
        "min_replicas": role.min_replicas,
        "max_replicas": role.max_replicas,
        "tolerance": role.tolerance,
        "scale_up_max_step": role.scale_up_max_step,
        "scale_up_max_percent": float(role.scale_up_max_percent),
        "scale_up_stabilization_seconds": float(role.scale_up_stabilization_seconds),
        "scale_down_stabilization_seconds": float(role.scale_down_stabilization_seconds),
    }
    if role.scale_to_zero_after is not None:
        fields["scale_to_zero_after_seconds"] = float(role.scale_to_zero_after)
    if isinstance(role, NormalRole | DecodeRole):
        fields["target_kv_cache_usage"] = role.target_kv_cache_usage
    if isinstance(role, PrefillRole):
        fields["target_budget_utilization"] = role.target_budget_utilization
    if isinstance(role, NormalRole | PrefillRole):
        fields["target_queued_tokens_per_replica"] = role.target_queued_tokens_per_replica
    return ScalingPolicy(**fields)


def pod_ready(pod: Body) -> bool:
    """Ready (the kubelet's readiness probe passed) and not on its way out."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def scrape_targets(pods: Sequence[Body]) -> dict[str, tuple[str, ...]]:
    """Pod name -> base URLs of its engines, one per data-parallel rank (its container's
    http ports), for every ready pod with an address."""
    targets = {}
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        if ip and pod_ready(pod):
            host = f"[{ip}]" if ":" in ip else ip
            ports = _http_ports(pod)
            targets[pod["metadata"]["name"]] = tuple(f"http://{host}:{p}" for p in ports)
    return targets


def _http_ports(pod: Body) -> list[int]:
    """The engine container's HTTP ports (http, http-1 ...: one per rank), rank 0 first."""
    containers = pod.get("spec", {}).get("containers") or []
    engine = next((c for c in containers if c.get("name") == ENGINE_CONTAINER), {})
    ports = sorted(
        p["containerPort"]
        for p in engine.get("ports") or []
        if str(p.get("name", "")).startswith("http") and isinstance(p.get("containerPort"), int)
    )
    return ports or [HTTP_PORT]


def pod_selector(name: str) -> dict[str, str]:
    """The labels of every engine pod of ModelDeployment `name`, all roles."""
    labels = selector_labels(name, RoleName.NORMAL)
    del labels[COMPONENT_LABEL]
    return labels


def evaluate(
    spec: ModelDeploymentSpec,
    replicas: Mapping[RoleName, int],
    pods: Sequence[Body],
    samples: Mapping[str, PodSample],
    queue: QueueState,
    memory: ScalerMemory,
    now: float,
) -> Evaluation:
    """The autoscaler's decision for every role, each on its own signals and history
    (decide_all: a full decode role holds prefill)."""
    # Only the spec's roles: a role that comes back after a mode change is a new role,
    # not one idle since it went.
    roles = spec.roles()
    role_pods = {role_name: pods_of(pods, role_name) for role_name in roles}
    observed: dict[RoleName, RoleObservation] = {}
    before: dict[RoleName, ScalingHistory] = {}
    for role_name, found in role_pods.items():
        targets = scrape_targets(found)
        loads = tuple(
            pod_load(samples[name], memory.samples.get(name))
            for name in (p["metadata"]["name"] for p in found)
            if name in samples
        )
        observed[role_name] = RoleObservation(
            current_replicas=replicas[role_name],
            pods=loads,
            unreadable=sum(n not in samples for n in targets),
            up=len(targets),  # the pods Kubernetes reports ready (and addressed)
        )
        # A role seen for the first time (a new model, or an operator that just
        # started) has no past to weigh a first reading against: see starting().
        before[role_name] = _after_unread(
            memory.histories.get(role_name), memory.queue_unread_since, now
        ) or ScalingHistory.starting(now, replicas[role_name])
    watermark = spec.engine.cache_prefill_watermark
    policies = {role_name: policy(role, watermark=watermark) for role_name, role in roles.items()}
    decisions = decide_all(observed, queue, policies, before, now)
    for role_name, decision in decisions.items():
        if decision.unreadable_changed:
            _log_readability(role_pods[role_name], observed[role_name], before[role_name],
                             decision, now)  # fmt: skip
    histories = {role_name: decision.history for role_name, decision in decisions.items()}
    # Pods that were not scraped this time keep their last sample: one failed
    # scrape must not cost the next evaluation its rate. Gone pods are dropped.
    alive = {p["metadata"]["name"] for p in pods}
    kept = {n: s for n, s in memory.samples.items() if n in alive and n not in samples}
    return Evaluation(decisions, ScalerMemory(histories, {**kept, **samples}, memory.deployments))


def _after_unread(
    history: ScalingHistory | None, unread_since: float | None, now: float
) -> ScalingHistory | None:
    """`history`, its idle clock moved on by the stretch the queue went unread: a model
    busy through a Redis outage would otherwise have read idle all along it."""
    if history is None or unread_since is None or history.last_active_at is None:
        return history
    active = min(now, history.last_active_at + (now - unread_since))
    return dataclasses.replace(history, last_active_at=active)


def _log_readability(
    role_pods: Sequence[Body],
    observed: RoleObservation,
    previous: ScalingHistory,
    decision: Decision,
    now: float,
) -> None:
    # Once per change, not per scrape: each failed scrape is only a DEBUG line
    # (engine_metrics.scrape), yet a role holding for want of metrics must show.
    # A role scaled to zero has nothing left to read: its scale-down said so.
    if not role_pods:
        return
    meta = role_pods[0]["metadata"]
    model = meta.get("labels", {}).get(INSTANCE_LABEL, "?")
    where = f"{meta.get('namespace', '')}/{model} {decision.role}"
    if decision.unreadable:
        log.warning(
            "%s: %s (%d scraped); autoscaling holds until one is (%s logs why at DEBUG)",
            where,
            decision.unreadable,
            observed.unreadable,
            SCRAPE_LOG,
        )
    elif previous.unreadable_since is not None:
        log.info("%s: metrics readable again after %gs", where, now - previous.unreadable_since)


def deletion_costs(pods: Sequence[Body], samples: Mapping[str, PodSample]) -> dict[str, int]:
    """controller.kubernetes.io/pod-deletion-cost for each pod of a role about to shrink.

    The ReplicaSet removes the lowest cost first (after pods that are not ready),
    so the least-loaded pods get the lowest costs: they drain soonest. Pods
    without a sample (starting, never read) cost 0, below every measured pod.
    """
    measured = [
        (drain_key(samples[name]), name)
        for name in (p["metadata"]["name"] for p in pods)
        if name in samples
    ]
    costs = {p["metadata"]["name"]: 0 for p in pods}
    for rank, (_, name) in enumerate(sorted(measured), start=1):
        costs[name] = rank
    return costs


def plan_resize(target: int, samples: Sequence[PodSample | None]) -> tuple[int, list[int]]:
    """How a role's active pods (their last samples, None for pods starting or not read
    yet) come to `target`: (pods to start, indexes of the pods to drain).

    Pods without a sample go first, as the ReplicaSet removes pods that are not
    ready first; then the least loaded (`drain_key`), in the order `deletion_costs`
    gives them. Ties keep the given order. For actuators that start and stop
    engines themselves: `tandem up` (local_actuator.py) and the simulator.
    """
    surplus = len(samples) - target
    if surplus <= 0:
        return -surplus, []

    def key(i: int) -> tuple[float, ...]:
        sample = samples[i]
        return (0.0,) if sample is None else (1.0, *drain_key(sample))

    return 0, sorted(range(len(samples)), key=key)[:surplus]


def drain_key(sample: PodSample) -> tuple[float, ...]:
    """How much a pod's drain costs, the least first: work in flight (what a drain
    waits for), then KV held, then queued prompts."""
    requests = (
        sample.requests_running
        + sample.requests_waiting
        + sample.kv_pinned_requests
        + sample.kv_receiving_requests
    )
    return (float(requests), sample.kv_cache_usage, float(sample.waiting_prompt_tokens))


def cost_changes(pods: Sequence[Body], costs: Mapping[str, int]) -> dict[str, int]:
    """The costs that differ from the pods' current annotations (only those are written)."""
    changes = {}
    for pod in pods:
        name = pod["metadata"]["name"]
        current = (pod["metadata"].get("annotations") or {}).get(DELETION_COST_ANNOTATION)
        if name in costs and current != str(costs[name]):
            changes[name] = costs[name]
    return changes
