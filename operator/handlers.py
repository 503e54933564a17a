"""The kopf handlers: thin, each a call into the Controller.

Built on a fresh kopf.OperatorRegistry per operator (never kopf's module-level
default), so a process can run several operators, as the tests do.

What wakes a reconciliation of a ModelDeployment:
- any event of the ModelDeployment (spec edits, and the status the operator
  writes, which finds nothing left to do);
- any event of a child (Deployment, Service, ConfigMap, Secret, PodDisruptionBudget
  labelled managed-by=tandem-operator): drift is repaired at once, and the
  status follows the Deployments' readiness;
- a timer every scrape interval: the autoscaler's evaluation, and a full resync
  in case an event was missed.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import kopf

from tandem.operator.controller import Controller
from tandem.operator.kube import KINDS
from tandem.operator.manifests import CHILD_KINDS, MANAGED_BY_LABEL, MODEL_LABEL, OPERATOR
from tandem.operator.settings import OperatorSettings
from tandem.operator.spec import GROUP, PLURAL, VERSION

MANAGED_BY = {MANAGED_BY_LABEL: OPERATOR}
CHILD_RESOURCES = tuple(KINDS[kind] for kind in CHILD_KINDS)
# kopf's own bookkeeping (finalizer, progress) under the operator's API group.
PREFIX = GROUP


def build_registry(
    controller: Controller,
    settings: OperatorSettings,
    login: Callable[..., kopf.ConnectionInfo | None],
    cleanup: Callable[[], Awaitable[None]] | None = None,
) -> kopf.OperatorRegistry:
    """The handlers of one operator instance."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(login)
    # The tasks running the autoscale timers (see `stop_timers`).
    timers: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="model")
    async def model_changed(
        event: kopf.RawEvent, namespace: str, name: str, memo: kopf.Memo, **_: Any
    ) -> None:
        if event["type"] == "DELETED":
            controller.forget(namespace, name)
        else:
            # The timer's memory (kopf keeps one memo per object): a lowered bound
            # drains the pods its last samples found least loaded.
            await controller.reconcile(namespace, name, memory=memo.get("autoscaler"))

    for child in CHILD_RESOURCES:

        @kopf.on.event(
            child.group,
            child.version,
            child.plural,
            labels=MANAGED_BY,
            registry=registry,
            id=f"child-{child.plural}",
        )
        async def child_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
            owner = labels.get(MODEL_LABEL)
            if owner:
                await controller.reconcile(namespace, owner)

    @kopf.timer(
        GROUP,
        VERSION,
        PLURAL,
        interval=settings.scrape_interval_s,
        # A failed pass (the API server away longer than kube.py's retries) is tried
        # again at the next tick, not after kopf's default 60 s: a restart of the API
        # server must not pause every model's autoscaling for a minute.
        backoff=settings.scrape_interval_s,
        registry=registry,
        id="autoscale",
    )
    async def autoscale(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
        task = asyncio.current_task()
        if task is not None:
            timers.add(task)
        memory = memo.get("autoscaler")
        memo["autoscaler"] = await controller.reconcile(
            namespace, name, autoscale=True, memory=memory
        )

    @kopf.on.cleanup(registry=registry)
    async def stop_timers(**_: Any) -> None:
        # An event still in flight when the operator began to stop can respawn a
        # timer after kopf stopped them all; it would then hold the exit for kopf's
        # 5 s hung-task timeout. Cleanup runs after event processing has ended.
        for task in list(timers):
            task.cancel()
        if cleanup is not None:
            await cleanup()

    return registry


def configure(kopf_settings: kopf.OperatorSettings, settings: OperatorSettings) -> None:
    """kopf settings the operator depends on, in production and in tests alike."""
    # The CRD's status schema is structural and has no place for kopf's progress
    # records (the API server would prune them): keep them in annotations.
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    kopf_settings.persistence.finalizer = f"{PREFIX}/operator"
    # Events are the Controller's own (a failed pass: one ReconcileFailed per streak);
    # kopf posts none of its log lines (a timer failing every 15 s would be an Event
    # every 15 s), which is its default.
    kopf_settings.posting.loggers = False
    kopf_settings.posting.level = logging.WARNING
    kopf_settings.posting.reporting_component = OPERATOR
    # A stopping timer finishes its pass (a few API calls) instead of being orphaned.
    kopf_settings.background.instant_exit_timeout = 1.0
    # Watch only the children we made, not every Deployment of the cluster.
    selector = ",".join(f"{key}={value}" for key, value in MANAGED_BY.items())
    for child in CHILD_RESOURCES:
        kopf_settings.watching.label_selectors[child.group or "v1", child.plural] = selector
    kopf_settings.peering.name = settings.peering_name
    kopf_settings.peering.priority = settings.priority
