"""A stand-in for the Deployment and ReplicaSet controllers (and the kubelet's readiness).

For every Deployment in the emulated API it keeps `spec.replicas` Pod objects
(labels from the template plus pod-template-hash, an owner reference to the
Deployment, a pod IP) and writes the Deployment's status as the real
controllers do: replicas, updatedReplicas, readyReplicas, availableReplicas,
observedGeneration. Which pods are ready is the test's knob (`set_ready`);
by default every pod is ready at once.

Like the ReplicaSet controller, a scale-down removes pods that are not ready
first, then the lowest controller.kubernetes.io/pod-deletion-cost, then the
newest; a changed pod template replaces every pod (no surge: the operator's
status logic only needs to see the counts move).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import itertools
import json
from typing import Any

from support.kube_api import DEPLOYMENTS, PODS, ApiServer, Body

COST = "controller.kubernetes.io/pod-deletion-cost"
HASH_LABEL = "pod-template-hash"


class DeploymentController:
    """Runs while entered (`async with`); reacts to Deployment and Pod changes."""

    def __init__(self, api: ApiServer) -> None:
        self._api = api
        # (namespace, name) -> how many pods are ready; absent: all of them.
        self._ready: dict[tuple[str, str], int] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sequence = itertools.count(1)
        api.listen(self._changed)

    async def __aenter__(self) -> DeploymentController:
        self._task = asyncio.create_task(self._run(), name="deployment stand-in")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def set_ready(self, namespace: str, name: str, ready: int | None) -> None:
        """How many pods of Deployment `name` pass readiness (None: all)."""
        if ready is None:
            self._ready.pop((namespace, name), None)
        else:
            self._ready[namespace, name] = ready
        self._mark(namespace, name)

    def _changed(self, resource: Any, kind: str, obj: Body) -> None:
        meta = obj["metadata"]
        if resource == DEPLOYMENTS:
            self._mark(meta["namespace"], meta["name"])
        elif resource == PODS:
            for owner in meta.get("ownerReferences") or []:
                if owner.get("kind") == "Deployment":
                    self._mark(meta["namespace"], owner["name"])

    def _mark(self, namespace: str, name: str) -> None:
        self._dirty.add((namespace, name))
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._dirty:
                await self._sync(*self._dirty.pop())

    async def _sync(self, namespace: str, name: str) -> None:
        deployment = self._api.read(DEPLOYMENTS, namespace, name)
        if deployment is None or deployment["metadata"].get("deletionTimestamp"):
            return  # garbage collection takes the pods
        uid = deployment["metadata"]["uid"]
        pods = [
            pod
            for pod in self._api.select(PODS, namespace)
            if any(o.get("uid") == uid for o in pod["metadata"].get("ownerReferences") or [])
        ]
        template = deployment["spec"]["template"]
        template_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
        template_hash = template_hash[:10]
        want = int(deployment["spec"].get("replicas", 1))
        current = []
        for pod in pods:
            if pod["metadata"]["labels"].get(HASH_LABEL) != template_hash:
                await self._api.delete(PODS, namespace, pod["metadata"]["name"])
            else:
                current.append(pod)
        if len(current) > want:
            victims = sorted(current, key=_removal_order)[: len(current) - want]
            for pod in victims:
                await self._api.delete(PODS, namespace, pod["metadata"]["name"])
            current = [pod for pod in current if pod not in victims]
        for _ in range(want - len(current)):
            current.append(await self._new_pod(deployment, template_hash))
        await self._set_readiness(namespace, name, sorted(current, key=_sequence_of))
        ready = sum(
            _ready(pod)
            for pod in self._api.select(PODS, namespace)
            if pod["metadata"]["name"] in {p["metadata"]["name"] for p in current}
        )
        status = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": len(current),
            "updatedReplicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": len(current) - ready,
        }
        await self._api.patch(
            DEPLOYMENTS, namespace, name, {"status": status}, subresource="status"
        )

    async def _new_pod(self, deployment: Body, template_hash: str) -> Body:
        meta = deployment["metadata"]
        template = copy.deepcopy(deployment["spec"]["template"])
        sequence = next(self._sequence)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{template_hash}-{sequence}",
                "namespace": meta["namespace"],
                "labels": {**template["metadata"].get("labels", {}), HASH_LABEL: template_hash},
                "annotations": dict(template["metadata"].get("annotations", {})),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template["spec"],
        }
        created = await self._api.create(PODS, meta["namespace"], pod)
        ip = f"10.244.{sequence // 250}.{sequence % 250 + 1}"
        status = {"phase": "Running", "podIP": ip, "conditions": [_condition(False)]}
        return await self._api.patch(
            PODS,
            meta["namespace"],
            created["metadata"]["name"],
            {"status": status},
            subresource="status",
        )

    async def _set_readiness(self, namespace: str, name: str, pods: list[Body]) -> None:
        ready = self._ready.get((namespace, name), len(pods))
        for index, pod in enumerate(pods):
            want = index < ready
            if _ready(pod) != want:
                status = {"conditions": [_condition(want)]}
                await self._api.patch(
                    PODS,
                    namespace,
                    pod["metadata"]["name"],
                    {"status": status},
                    subresource="status",
                )


def _ready(pod: Body) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _condition(ready: bool) -> dict[str, str]:
    return {"type": "Ready", "status": "True" if ready else "False"}


def _sequence_of(pod: Body) -> int:
    return int(pod["metadata"]["name"].rsplit("-", 1)[1])


def _removal_order(pod: Body) -> tuple[bool, int, int]:
    """The ReplicaSet's preference: not ready, then lowest deletion cost, then newest."""
    cost = (pod["metadata"].get("annotations") or {}).get(COST, "0")
    return (_ready(pod), int(cost), -_sequence_of(pod))
