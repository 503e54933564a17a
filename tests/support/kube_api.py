"""An emulated Kubernetes API server: kmock's emulator with what a real one does filled in.

kmock (by kopf's author) serves Kubernetes-shaped HTTP and keeps objects in
memory, but as a dict store. Measured against what kopf and the operator use,
it lacks: uid and resourceVersion assignment, generation, generateName, label
selectors, status isolation, the /api/v1/namespaces path (it reads
/api/v1/namespaces/NAME as "everything in namespace NAME" and fails on the
bare collection), 422 for a failed JSON-patch test (it answers 500), the
admission of custom resources, owner-reference garbage collection, and a
watch that cannot lose a change between its snapshot and its stream (it
subscribes after sending the snapshot). It also stores a write even when a
test's reaction answers it with an error, so it cannot inject failures. Its
discovery says Kubernetes 1.26 and names the core group "/v1" (Helm's mapper
then finds no core kind), and a refusal raised while serving became a 500.

The write semantics are kube_store.ApiStore's; ApiServer is the HTTP side:
every request on a known resource is answered here (get, list and watch with
label selectors; watches snapshot and subscribe under one lock; the
namespaces path; create, merge or JSON patch, delete; fieldValidation=Strict,
which refuses a built-in object's unknown fields), discovery stays kmock's,
and `fail_next` answers matching requests with an injected error (409,
500...) before anything is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

from support.kube_store import (
    CHILDREN,
    CLUSTER_PEERINGS,
    DEPLOYMENTS,
    EVENTS,
    MODELS,
    NAMESPACES,
    PEERINGS,
    PODS,
    SECRETS,
    ApiError,
    ApiStore,
    Body,
    not_found,
    selector_matches,
)
from support.kube_version import K8S_VERSION

__all__ = [
    "CHILDREN",
    "CLUSTER_PEERINGS",
    "DEPLOYMENTS",
    "EVENTS",
    "MODELS",
    "NAMESPACES",
    "PEERINGS",
    "PODS",
    "SECRETS",
    "ApiError",
    "ApiServer",
    "Body",
]

_NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces(?:/(?P<name>[^/]+))?/?$")


@dataclass
class _Fault:
    method: str
    resource: kmock.resource
    name: str | None
    subresource: str | None
    status: int
    reason: str
    times: int
    message: str | None


@attrs.define(kw_only=True)
class ApiServer(ApiStore):
    """The HTTP side of the emulated API server (module docstring)."""

    _faults: list[_Fault] = attrs.field(factory=list, init=False)

    def fail_next(
        self,
        method: str,
        resource: kmock.resource,
        name: str | None = None,
        *,
        subresource: str | None = None,
        status: int = 409,
        reason: str = "Conflict",
        times: int = 1,
        message: str | None = None,
    ) -> None:
        """Answer the next `times` matching requests with `status` (and `message`, else
        one naming the fault) instead of serving them."""
        fault = _Fault(method.upper(), resource, name, subresource, status, reason, times, message)
        self._faults.append(fault)

    def clear_faults(self) -> None:
        """Serve every request again (faults not yet served are dropped)."""
        self._faults.clear()

    @property
    def faults_left(self) -> int:
        return sum(fault.times for fault in self._faults)

    # ------------------------------------------------------------------ HTTP

    async def _serve_version(self, request: rendering.Request) -> Any:
        # The core group's list names its version "v1"; kmock says "/v1", which Helm's
        # mapper cannot parse (no Secret or Service kind found).
        payload = await super()._serve_version(request)
        payload["groupVersion"] = payload["groupVersion"].lstrip("/")
        return payload

    async def _serve_server_version(self, request: rendering.Request) -> dict[str, str]:
        # The release every manifest is validated against (kmock says 1.26, which the
        # chart's kubeVersion refuses).
        major, minor = K8S_VERSION.split(".")
        return {"major": major, "minor": minor, "gitVersion": f"v{K8S_VERSION}.0"}

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = _NAMESPACE_PATH.fullmatch(raw_request.path)
        if match is None:
            return await super().__call__(raw_request)
        # kmock's own parsing reads /api/v1/namespaces/NAME as a namespace prefix.
        body = await raw_request.read()
        request = rendering.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            body=body,
            text=body.decode(),
            data=json.loads(body) if body else None,
            resource=NAMESPACES,
            name=match["name"],
            action=_action(raw_request.method, match["name"], raw_request.query.get("watch")),
        )
        self._requests.append(request)
        return await self._handle(request)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        # A refusal is a Status object with its code, as the API server answers it
        # (kmock's own handling let it through as a 500 with a traceback).
        try:
            return await self._serve(request)
        except kmock.KubernetesError as error:
            return await self._render_error(error)

    async def _serve(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        resource = request.resource
        if resource is None or resource.plural is None:
            return await super()._handle(request)  # discovery: kmock's own
        if resource not in self.resources:
            raise kmock.KubernetesResourceNotFoundError()
        self._raise_fault(request)
        namespace, name, sub = request.namespace, request.name, request.subresource
        action = request.action
        if action == kmock.action.WATCH:
            return await self._watch(request)
        if action == kmock.action.LIST:
            return _json(self._list_body(resource, namespace, request.params))
        if action == kmock.action.FETCH:
            found = self.read(resource, namespace, name or "")
            if found is None:
                raise not_found(resource, name)
            return _json(found)
        strict = request.params.get("fieldValidation") == "Strict"
        dry = request.params.get("dryRun") == "All"
        async with self._lock:
            if action == kmock.action.CREATE:
                created = await self._create(
                    resource, namespace, request.data or {}, self.admission, strict, dry
                )
                return _json(created, status=201)
            if action == kmock.action.UPDATE and name is not None:
                patch, admit = request.data, self.admission
                return _json(
                    await self._patch(resource, namespace, name, patch, sub, admit, strict, dry)
                )
            if action == kmock.action.DELETE and name is not None:
                return _json(await self._delete(resource, namespace, name))
        raise ApiError(405, "MethodNotAllowed", f"{request.method} is not served here")

    def _raise_fault(self, request: rendering.Request) -> None:
        for fault in self._faults:
            if (
                fault.method == request.method.value
                and fault.resource == request.resource
                and fault.name in (None, request.name)
                and fault.subresource == request.subresource
            ):
                fault.times -= 1
                if fault.times <= 0:
                    self._faults.remove(fault)
                raise ApiError(
                    fault.status,
                    fault.reason,
                    fault.message or f"injected {fault.status} {fault.reason}",
                )

    def _list_body(
        self, resource: kmock.resource, namespace: str | None, params: Mapping[str, str]
    ) -> Body:
        return {
            "apiVersion": "v1",
            "kind": "List",
            "items": self.select(resource, namespace, params.get("labelSelector", "")),
            "metadata": {"resourceVersion": str(self._rv)},
        }

    async def _watch(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """Every matching object as ADDED, then every matching change, until the client goes."""
        resource, namespace = request.resource, request.namespace
        selector = request.params.get("labelSelector", "")
        raw = request._raw_request
        assert raw is not None and resource is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        bus = self._buses[resource]
        # Snapshot and subscription under one lock: no change can fall between them.
        async with self._lock:
            snapshot = self.select(resource, namespace, selector)
            marker = await bus.mark()
        timeout = float(request.params.get("timeoutSeconds") or 0) or None

        async def relay() -> None:
            for obj in snapshot:
                await response.write(_line({"type": "ADDED", "object": obj}))
            async for event in bus.stream(since=marker):
                obj = event["object"]
                here = namespace is None or obj["metadata"].get("namespace") == namespace
                if here and selector_matches(selector, obj["metadata"].get("labels") or {}):
                    await response.write(_line(event))

        # aiohttp does not cancel a handler when its client goes: look every half second.
        relaying = asyncio.create_task(relay())
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while not relaying.done():
                await asyncio.wait({relaying}, timeout=0.5)
                gone = raw.transport is None or raw.transport.is_closing()
                if gone or (deadline is not None and loop.time() > deadline):
                    relaying.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await relaying
        finally:
            relaying.cancel()
            await bus.unmark(marker)
        return response


def _action(method: str, name: str | None, watch: str | None) -> kmock.action | None:
    if method == "GET":
        if watch == "true":
            return kmock.action.WATCH
        return kmock.action.FETCH if name else kmock.action.LIST
    verbs = {"POST": kmock.action.CREATE, "PATCH": kmock.action.UPDATE}
    return verbs.get(method, kmock.action.DELETE if method == "DELETE" else None)


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)


def _line(event: Mapping[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"
