"""One reconciliation pass of a ModelDeployment: read, plan (pure), write.

Level-triggered: whatever woke it (a change of the ModelDeployment, of one of
its children, or the periodic autoscaler tick), a pass reads the current
object and children, asks reconcile.plan what should change and writes only
that. Passes of one ModelDeployment never overlap (a lock per object), so a
burst of child events cannot race two creates of the same Deployment.

The writes, in their order, are plan_writer.py's.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from tandem import catalog
from tandem.operator import scaling
from tandem.operator.autoscaler import Decision
from tandem.operator.drift import ChildKey
from tandem.operator.events import Event, queue_events, readability_events
from tandem.operator.kube import KubeApi
from tandem.operator.manifests import (
    CHILD_KINDS,
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    OPERATOR,
    SPEC_REPLICAS_ANNOTATION,
    OperatorDefaults,
    child_name,
    pods_of,
)
from tandem.operator.object_locks import ObjectLocks
from tandem.operator.plan_writer import PlanWriter, utc_now
from tandem.operator.pod_load import PodSample
from tandem.operator.reconcile import Plan, plan
from tandem.operator.replica_counts import role_replicas
from tandem.operator.role_name import RoleName
from tandem.operator.served_names import served_name_holder
from tandem.operator.settings import OperatorSettings
from tandem.operator.sources import MetricSources
from tandem.operator.spec import KIND, ModelDeploymentSpec
from tandem.operator.validation import InvalidSpec, validate_spec
from tandem.redaction import check_redis_url, redacted

log = logging.getLogger(__name__)

Body = dict[str, Any]


@dataclass(frozen=True)
class _Scaling:
    """What an autoscaler evaluation asks of this pass."""

    memory: scaling.ScalerMemory
    changed: Mapping[RoleName, Decision] = field(default_factory=dict)
    # Pod name -> deletion cost, written before the scale-down.
    costs: Mapping[str, int] = field(default_factory=dict)
    # The pods' metrics, when the evaluation read them.
    samples: Mapping[str, PodSample] | None = None
    # Roles whose metrics became unreadable, or readable again (events.readability_events).
    notices: tuple[Event, ...] = ()


class Controller:
    """Reconciles ModelDeployments; one per operator instance (it holds the per-object locks)."""

    def __init__(
        self,
        kube: KubeApi,
        sources: MetricSources,
        settings: OperatorSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        watch_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kube = kube
        self._writer = PlanWriter(kube)
        self._sources = sources
        self._settings = settings
        self._defaults = OperatorDefaults(
            image=settings.engine_image,
            image_pull_secrets=settings.engine_image_pull_secrets,
            run_as_user=settings.engine_run_as_user,
            redis_url=settings.redis_url,
            key_prefix=settings.key_prefix,
        )
        # The autoscaler's clock (seconds, monotonic); tests pass a fake one.
        self._clock = clock
        # Real time, for how long ago a memory was left: a replica that stood by while
        # another led, or whose passes failed, watched nothing in between.
        self._watch_clock = watch_clock
        self._memory_lapse_s = max(4 * settings.scrape_interval_s, 2.0)
        # Each evaluation renews the model's catalog entry; a deleted model's lapses.
        self._declaration_ttl_s = catalog.declaration_ttl_s(settings.scrape_interval_s)
        self._locks = ObjectLocks()
        # Models whose last pass failed (an Event said so once).
        self._failing: set[tuple[str, str]] = set()

    async def reconcile(
        self,
        namespace: str,
        name: str,
        *,
        autoscale: bool = False,
        memory: scaling.ScalerMemory | None = None,
    ) -> scaling.ScalerMemory | None:
        """Converge one ModelDeployment; with `autoscale`, evaluate the autoscaler first.

        Returns the autoscaler's memory for the next evaluation (the caller keeps it).
        Without `autoscale`, `memory` (the last evaluation's) only ranks the pods of a
        role the pass shrinks, those not read now by their last samples.
        """
        async with self._locks.hold((namespace, name)):
            model = await self._kube.get(KIND, namespace, name)
            if model is None:
                # Gone (a child's event can come after its owner's): nothing to converge.
                self.forget(namespace, name)
                return memory
            if model["metadata"].get("deletionTimestamp"):
                return memory  # garbage collection removes the children
            if autoscale:
                memory = self._kept_up(namespace, name, memory)
            try:
                memory = await self._reconcile(model, autoscale, memory)
            except Exception as error:
                await self._failed(model, error)
                raise  # kopf retries the timer at its next tick; the log has the trace
            self._failing.discard((namespace, name))
            if memory is None or memory.queue_unreadable is not None:
                return memory  # nothing evaluated: as old as the last evaluation
            return dataclasses.replace(memory, watched_at=self._watch_clock())

    def _kept_up(
        self, namespace: str, name: str, memory: scaling.ScalerMemory | None
    ) -> scaling.ScalerMemory | None:
        """`memory`, unless passes stopped long enough to leave a gap in what it saw:
        windows and idle times counted across the gap would scale on a past this
        replica never watched (docs/autoscaling.md: a new leader waits a window)."""
        if memory is None or memory.watched_at is None:
            return memory
        lapse = self._watch_clock() - memory.watched_at
        if lapse <= self._memory_lapse_s:
            return memory
        if memory.queue_unreadable is not None:
            # Still unread: the outage is said once (its Event), and ends with one.
            log.info(
                "%s/%s: the queue unread for %.0f s: the autoscaler's memory starts afresh",
                namespace,
                name,
                lapse,
            )
            return scaling.ScalerMemory(queue_unreadable=memory.queue_unreadable)
        log.info(
            "%s/%s: autoscaler memory %.0f s old (this replica stood by, or its passes "
            "failed): it starts afresh",
            namespace,
            name,
            lapse,
        )
        return None

    async def _failed(self, model: Body, error: Exception) -> None:
        """One Warning Event per streak of failed passes (kopf posts none: every 15 s
        would bury the model's Events), for `kubectl describe`."""
        key = (model["metadata"]["namespace"], model["metadata"]["name"])
        if key in self._failing:
            return
        self._failing.add(key)
        message = redacted(f"{error}"[:1000] or type(error).__name__)
        failed = Event("ReconcileFailed", f"{message}; retried", warning=True)
        await self._writer.post(model, (failed,))

    def forget(self, namespace: str, name: str) -> None:
        """The ModelDeployment is gone: a new one of its name starts no failure streak,
        and no drift left alone."""
        self._failing.discard((namespace, name))
        self._writer.forget(namespace, name)

    async def _reconcile(
        self, model: Body, autoscale: bool, memory: scaling.ScalerMemory | None
    ) -> scaling.ScalerMemory | None:
        namespace, name = model["metadata"]["namespace"], model["metadata"]["name"]
        children, pods, models = await asyncio.gather(
            self._children(namespace, name),
            self._kube.list("Pod", namespace, scaling.pod_selector(name)),
            self._models(),
        )
        holder = served_name_holder(model, models, self._defaults.redis_url)
        # A model that may not serve its name neither reads nor declares that name's queue,
        # and what its pods do meanwhile goes unwatched: its past is unknown after.
        if autoscale and holder is not None:
            memory = scaling.ScalerMemory()
        scale = autoscale and holder is None
        outcome = await self._autoscale(model, children, pods, memory) if scale else None
        actions = plan(
            model,
            children,
            self._defaults,
            now=utc_now(),
            scaled=outcome.changed if outcome else {},
            pods=pods,
            holder=holder,
            undone=self._writer.undone(namespace, name),
        )
        costs = await self._costs(actions, pods, outcome, memory)
        await self._writer.apply(model, actions, costs)
        await self._writer.post(model, outcome.notices if outcome else ())
        return outcome.memory if outcome else memory

    async def _models(self) -> list[Body]:
        """Every ModelDeployment this operator serves, all namespaces: a served name is
        one queue in the shared Redis, whichever namespace claims it (another team's
        model of the same name would take this one's prompts)."""
        if not self._settings.namespaces:
            return await self._kube.list(KIND, None, {})
        pages = await asyncio.gather(
            *(self._kube.list(KIND, ns, {}) for ns in self._settings.namespaces)
        )
        return [model for page in pages for model in page]

    async def _children(self, namespace: str, name: str) -> list[Body]:
        selector = {INSTANCE_LABEL: name, MANAGED_BY_LABEL: OPERATOR}
        pages = await asyncio.gather(
            *(self._kube.list(kind, namespace, selector) for kind in CHILD_KINDS)
        )
        return [child for page in pages for child in page]

    # ------------------------------------------------------------------ autoscaling

    async def _autoscale(
        self,
        model: Body,
        children: list[Body],
        pods: list[Body],
        memory: scaling.ScalerMemory | None,
    ) -> _Scaling | None:
        meta = model["metadata"]
        memory = memory or scaling.ScalerMemory()
        try:
            spec = validate_spec(model.get("spec"), name=meta["name"])
        except InvalidSpec:
            # The plan reports it; nothing to scale, and the stretch goes unwatched.
            return _Scaling(scaling.ScalerMemory())
        found = {ChildKey(c["kind"], c["metadata"]["name"]): c for c in children}
        replicas = role_replicas(spec, meta["name"], found, model.get("status") or {}, {})
        deployments = {
            role: _watched_as(found[key])
            for role in spec.roles()
            if (key := ChildKey("Deployment", child_name(meta["name"], role))) in found
        }
        memory = memory.watching(deployments)
        if len(deployments) < len(spec.roles()):
            return _Scaling(memory)  # roles still being created: nothing to measure yet
        namespace = meta["namespace"]
        try:
            redis_url = await self._redis_url(namespace, spec)
            served = spec.served_model_name(meta["name"])
            queue = await self._sources.queues.depth(redis_url, served)
            await self._sources.queues.declare(
                redis_url, served, f"{namespace}/{meta['name']}", self._declaration_ttl_s
            )
        except (redis.RedisError, OSError, LookupError, ValueError) as error:
            # Without the queue, an idle-looking model may be drowning in requests:
            # skip this evaluation rather than scale down on half the picture. The past
            # is kept, as old as the last evaluation: an outage longer than a few
            # intervals forgets it (_kept_up), so that it never counts as idle time
            # after. (Forgotten at each failed read, a blip every few minutes held a
            # role at its peak for good, and kept it from scaling to zero.)
            log.warning(
                "%s/%s: no queue depth (%s); autoscaling skipped", namespace, meta["name"], error
            )
            why = str(error) or type(error).__name__
            return _Scaling(
                memory.queue_unread(why, self._clock()),
                notices=queue_events(memory.queue_unreadable, why),
            )
        samples = await self._sources.sample_all(scaling.scrape_targets(pods))
        evaluation = scaling.evaluate(spec, replicas, pods, samples, queue, memory, self._clock())
        shrinking = [role for role, d in evaluation.changed.items() if d.replicas < d.current]
        # Ranked by their last samples, those not read this time too: a busy pod whose
        # scrape failed once cost 0, and went first (a pod not ready goes first anyway).
        last = evaluation.memory.samples
        costs = _deletion_costs(pods, shrinking, last)
        notices = queue_events(memory.queue_unreadable, None)
        notices += readability_events(evaluation.decisions)
        return _Scaling(evaluation.memory, evaluation.changed, costs, last, notices)

    async def _costs(
        self,
        actions: Plan,
        pods: list[Body],
        outcome: _Scaling | None,
        memory: scaling.ScalerMemory | None,
    ) -> dict[str, int]:
        """The autoscaler's deletion costs, and those of roles a moved bound or an edit of
        spec.<role>.replicas shrinks: the least-loaded pods go first there too, pods not
        read now ranked by their last samples (`memory`'s)."""
        costs = dict(outcome.costs) if outcome else {}
        shrinking = actions.shrinking
        if shrinking:
            samples = outcome.samples if outcome else None
            if samples is None:
                targets = [p for role in shrinking for p in pods_of(pods, role)]
                read = await self._sources.sample_all(scaling.scrape_targets(targets))
                samples = {**(memory.samples if memory else {}), **read}
            costs.update(_deletion_costs(pods, shrinking, samples))
        return costs

    async def _redis_url(self, namespace: str, spec: ModelDeploymentSpec) -> str:
        """The Redis the model's engines use: spec.redis (a URL or a Secret) or the operator's."""
        if spec.redis is None:
            return self._settings.redis_url
        if spec.redis.url is not None:
            return spec.redis.url
        ref = spec.redis.url_secret_ref
        if ref is None:
            # validate_spec holds the spec to exactly one of the two: a spec without
            # either is reported (and the evaluation skipped) rather than trusted.
            raise ValueError("spec.redis has neither url nor urlSecretRef")
        secret = await self._kube.get("Secret", namespace, ref.name)
        if secret is None or ref.key not in (secret.get("data") or {}):
            raise LookupError(f"Secret {ref.name} has no key {ref.key!r}")
        where = f"Secret {ref.name}'s key {ref.key!r}"
        try:
            url = base64.b64decode(secret["data"][ref.key]).decode()
        except ValueError:  # the decoder's reason quotes a byte of it
            raise ValueError(f"{where} is not UTF-8 text") from None
        # As the engines read it (secretKeyRef, raw: a file's newline is let pass, a
        # leading space not). What the URL holds stays out of the Event and log.
        check_redis_url(url, where)
        return url


def _deletion_costs(
    pods: list[Body], roles: list[RoleName], samples: Mapping[str, PodSample]
) -> dict[str, int]:
    """Pod-deletion costs for roles about to shrink (those that differ from the pods')."""
    costs: dict[str, int] = {}
    for role_name in roles:
        role_pods = pods_of(pods, role_name)
        costs.update(scaling.cost_changes(role_pods, scaling.deletion_costs(role_pods, samples)))
    return costs


def _watched_as(deployment: Body) -> str:
    """What a role's autoscaling history is the history of: its Deployment (a new one
    has no past) at the count an edit of spec.<role>.replicas last set. The edit is a
    new start: weighed against the readings from before it, a count raised ahead of a
    burst went back down as soon as its pods were ready."""
    meta = deployment["metadata"]
    edit = (meta.get("annotations") or {}).get(SPEC_REPLICAS_ANNOTATION, "")
    return f"{meta.get('uid', '')}@{edit}"
