"""PlanWriter: a pass's plan written to the Kubernetes API, in its order.

Pod-deletion costs before the replica change they prepare (the ReplicaSet reads
them when it picks pods to remove; best effort, a pod refusing one is passed by),
children next (all checked by a dry run before
any is written, so a refused child leaves the others as they were), Events, and the
status last, so the status never claims what was not done. A create that finds the
child's name taken adopts the object if it is the model's (child_owners.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.operator.child_owners import ChildTaken, check_not_taken
from tandem.operator.drift import ChildKey, ChildPatch, repair_patch
from tandem.operator.events import Event, with_adoptions
from tandem.operator.kube import ApiError, KubeApi
from tandem.operator.reconcile import Plan, child_taken, forbidden, refused
from tandem.operator.spec import KIND

log = logging.getLogger(__name__)

Body = dict[str, Any]


class PlanWriter:
    """Writes plans through one KubeApi."""

    def __init__(self, kube: KubeApi) -> None:
        self._kube = kube
        # Per model (namespace, name): each child's last repair that changed no spec (an
        # admission webhook wrote the drift back), not written again while the same (a
        # spec edit makes another): patched every pass, the model read RollingOut for
        # ever and posted an Event each time.
        self._undone: dict[tuple[str, str], dict[ChildKey, ChildPatch]] = {}

    def undone(self, namespace: str, name: str) -> Mapping[ChildKey, ChildPatch]:
        return self._undone.get((namespace, name), {})

    def forget(self, namespace: str, name: str) -> None:
        self._undone.pop((namespace, name), None)

    async def apply(self, model: Body, actions: Plan, costs: Mapping[str, int]) -> None:
        """Make the plan's writes: pod-deletion costs, children, Events, the status. A
        child refused or taken turns the pass into the refusal's plan, written instead."""
        meta = model["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        for pod, cost in costs.items():
            await self._set_deletion_cost(namespace, pod, cost)
        if actions.creates and not await self._still_there(model):
            # Deleted while this pass ran (before kopf's finalizer was on): the children
            # the garbage collector just took would be made again for nobody.
            return
        try:
            # Every write checked before any is made: a child the API server refuses
            # must not leave the others changed (one role rolled to the new spec and
            # the other not, a ConfigMap ahead of its Deployment).
            if len(actions.creates) + len(actions.patches) > 1:
                await self._write(namespace, actions, dry_run=True)
            adopted, written = await self._write(namespace, actions, dry_run=False)
            await self._note_undone(model, actions.patches, written)
            for key in actions.deletes:  # a refused one is said as a refused write is
                await self._kube.delete(key.kind, namespace, key.name)
        except ChildTaken as taken:
            await self.apply(model, child_taken(model, str(taken), now=utc_now()), {})
            return
        except ApiError as error:
            if error.forbidden:
                # Said in the status and an Event, not only the log; the next pass
                # (a child's event, the timer) tries again.
                await self.apply(model, forbidden(model, str(error), now=utc_now()), {})
                return
            if not error.refused:
                raise  # retried with backoff
            # The spec passed our checks but builds a child the API server refuses
            # (a rule only it knows): say so in the status, not in a retry loop.
            await self.apply(model, refused(model, str(error), now=utc_now()), {})
            return
        await self.post(model, with_adoptions(actions.events, adopted))
        if actions.status is not None:
            await self._kube.patch_status(KIND, namespace, name, actions.status)
        if actions.touches_children:
            log.info(
                "%s/%s: created %s; patched %s; deleted %s",
                namespace,
                name,
                [f"{c['kind']}/{c['metadata']['name']}" for c in actions.creates],
                [f"{p.kind}/{p.name} ({', '.join(p.drift)})" for p in actions.patches],
                [f"{k.kind}/{k.name}" for k in actions.deletes],
            )

    async def _set_deletion_cost(self, namespace: str, pod: str, cost: int) -> None:
        """Best effort: a cost only orders which pods a scale-down takes. One pod a policy
        protects (a 403 or 422 to its patch) must not stop the pass: the scale-down, every
        edit written with it and the status would wait on it for good."""
        try:
            await self._kube.set_pod_deletion_cost(namespace, pod, cost)
        except ApiError as error:
            if not (error.forbidden or error.refused):
                raise  # retried with backoff
            log.warning("%s/%s: deletion cost not written, scaling on: %s", namespace, pod, error)

    async def _still_there(self, model: Body) -> bool:
        """Whether the ModelDeployment this pass read is still there, not being deleted."""
        meta = model["metadata"]
        current = await self._kube.get(KIND, meta["namespace"], meta["name"])
        if current is None:
            return False
        now = current["metadata"]
        return now.get("uid") == meta.get("uid") and not now.get("deletionTimestamp")

    async def _write(
        self, namespace: str, actions: Plan, *, dry_run: bool
    ) -> tuple[set[str], list[Body | None]]:
        """The plan's creates and patches; returns the children found already there and
        adopted instead of created ("Deployment m-decode"), and each patched child as
        the API server answered (None: gone)."""
        adopted = set()
        for manifest in actions.creates:
            if await self._create(manifest, dry_run=dry_run):
                adopted.add(f"{manifest['kind']} {manifest['metadata']['name']}")
        written = [
            await self._kube.patch(patch.kind, namespace, patch.name, patch.patch, dry_run=dry_run)
            for patch in actions.patches
        ]
        return adopted, written

    async def _note_undone(
        self, model: Body, patches: Sequence[ChildPatch], written: Sequence[Body | None]
    ) -> None:
        """Note the patches that changed no spec (their child's generation as it was),
        each said once in a Warning Event; a repair that took clears its child's note."""
        meta = model["metadata"]
        notes = self._undone.setdefault((meta["namespace"], meta["name"]), {})
        for patch, child in zip(patches, written, strict=True):
            key = ChildKey(patch.kind, patch.name)
            spec = [path for path in patch.drift if path.startswith("spec.")]
            generation = (child or {}).get("metadata", {}).get("generation")
            if not spec or patch.generation is None or generation != patch.generation:
                notes.pop(key, None)
                continue
            notes[key] = dataclasses.replace(patch, generation=None)
            message = (
                f"{patch.kind} {patch.name}: {', '.join(spec)} written back as it was by "
                "the API server (a mutating admission webhook?); left as the cluster "
                "keeps it until it differs otherwise"
            )
            await self.post(model, (Event("DriftKept", message, warning=True),))
        if not notes:
            self._undone.pop((meta["namespace"], meta["name"]), None)

    async def post(self, model: Body, events: Sequence[Event]) -> None:
        for event in events:
            await self._kube.post_event(
                model, reason=event.reason, message=event.message, warning=event.warning
            )

    async def _create(self, manifest: Body, *, dry_run: bool = False) -> bool:
        """Creates the child, or adopts one of its name already there: whether it adopted.
        ChildTaken if that one is not the model's (child_owners.py), in the dry run too:
        the real writes must not begin (the children before it made, the model then
        frozen)."""
        try:
            await self._kube.create(manifest, dry_run=dry_run)
            return False
        except ApiError as error:
            if not error.already_exists:
                raise
            meta = manifest["metadata"]
            existing = await self._kube.get(manifest["kind"], meta["namespace"], meta["name"])
            if existing is None:
                if dry_run:
                    return False  # gone meanwhile: the real write creates it
                raise
            check_not_taken(manifest, existing)
            if dry_run:
                return False
            # Made meanwhile (a user, or an older incarnation of this object): adopt it.
            await self._kube.patch(
                manifest["kind"], meta["namespace"], meta["name"], repair_patch(manifest, existing)
            )
            return True


def utc_now() -> str:
    """Now, as the status's and conditions' times are written (RFC 3339, seconds)."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
