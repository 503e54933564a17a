"""All Kubernetes API I/O of the operator: one async REST client, with retries and backoff.

Why httpx rather than the `kubernetes` client: kopf runs on asyncio, and the
official client is synchronous (every call would hold a thread of a pool that
kopf's own sync handlers share), while kubernetes_asyncio would be one more
dependency for a dozen calls. The operator needs get, list, create, merge-patch
and delete of six kinds, one subresource and Events, so a thin layer over
httpx (already a dependency: engine scraping) is less code than either, and it
keeps the retry policy in one place. The `kubernetes` package still does what
it is best at: finding credentials (kube_connection.py).

Retries: connection errors, 409 Conflict (other than AlreadyExists on create),
429 and 5xx are retried with capped, fully jittered exponential backoff (and
Retry-After when the server gives one); 401 re-reads the credentials once;
anything else is raised as ApiError at once, since repeating it cannot help.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from tandem.operator.kube_connection import Connection
from tandem.operator.manifests import OPERATOR, pod_deletion_cost_patch
from tandem.operator.spec import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger(__name__)

Body = dict[str, Any]
_RETRYABLE = frozenset({409, 429, 500, 502, 503, 504})
# Writes of objects built from a user's spec: an unknown field (a typo in a pod
# `affinity`, copied verbatim) is a 400 that names it, which makes the model
# Invalid, where the default (Warn) drops the field and the pod runs without it.
STRICT = {"fieldValidation": "Strict"}


def _write_params(dry_run: bool) -> dict[str, str]:
    return {**STRICT, "dryRun": "All"} if dry_run else STRICT


@dataclass(frozen=True)
class ApiResource:
    """Where a kind lives in the API."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    def path(
        self, namespace: str | None, name: str | None = None, subresource: str | None = None
    ) -> str:
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [root]
        if self.namespaced and namespace is not None:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        parts.extend(part for part in (name, subresource) if part)
        return "/".join(parts)


# Every kind the operator reads or writes, by `kind`.
KINDS: Mapping[str, ApiResource] = {
    KIND: ApiResource(GROUP, VERSION, PLURAL),
    "ConfigMap": ApiResource("", "v1", "configmaps"),
    "Service": ApiResource("", "v1", "services"),
    "Deployment": ApiResource("apps", "v1", "deployments"),
    "PodDisruptionBudget": ApiResource("policy", "v1", "poddisruptionbudgets"),
    "Pod": ApiResource("", "v1", "pods"),
    "Event": ApiResource("", "v1", "events"),
    "Secret": ApiResource("", "v1", "secrets"),
    # Only listed at start (operator/main.py): the CRD the API server serves, kopf's
    # peering objects.
    "CustomResourceDefinition": ApiResource(
        "apiextensions.k8s.io", "v1", "customresourcedefinitions", namespaced=False
    ),
    "KopfPeering": ApiResource("kopf.dev", "v1", "kopfpeerings"),
    "ClusterKopfPeering": ApiResource("kopf.dev", "v1", "clusterkopfpeerings", namespaced=False),
}


class ApiError(Exception):
    """The API server refused a request; str() says which request and why."""

    def __init__(self, status: int, reason: str, message: str, request: str) -> None:
        super().__init__(f"{request}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def retryable(self) -> bool:
        # AlreadyExists is a 409 too, but creating again can only fail again.
        return self.status in _RETRYABLE and self.reason != "AlreadyExists"

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def forbidden(self) -> bool:
        """403: a quota, an admission policy or RBAC, which may lift without a spec change."""
        return self.status == 403

    @property
    def refused(self) -> bool:
        """The object itself is invalid (400, 422): only a changed spec can pass."""
        return self.status in (400, 422)


@dataclass(frozen=True)
class Backoff:
    """Capped exponential backoff with full jitter (AWS' "full jitter")."""

    attempts: int = 6
    base_s: float = 0.2
    cap_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.cap_s < self.base_s:
            raise ValueError(f"bad backoff: {self}")

    def delays(self) -> Iterator[float]:
        """One delay before each retry (attempts - 1 of them)."""
        for retry in range(self.attempts - 1):
            yield random.uniform(0, min(self.cap_s, self.base_s * 2**retry))


class KubeApi:
    """The operator's Kubernetes client. Create it inside the running event loop."""

    def __init__(
        self,
        connection: Connection,
        *,
        backoff: Backoff | None = None,
        timeout_s: float = 30.0,
        instance: str = "",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._connection = connection
        self._backoff = backoff or Backoff()
        self._timeout = timeout_s
        # Who posts our Events (reportingInstance): the operator pod.
        self._instance = instance
        # Tests pass an httpx.MockTransport; None is the network.
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self._connection.server,
                verify=self._connection.ssl_context(),
                timeout=self._timeout,
                headers={"User-Agent": f"{OPERATOR}/httpx", "Accept": "application/json"},
                transport=self._transport,
            )
        return self._client

    # ------------------------------------------------------------------ verbs

    async def get(self, kind: str, namespace: str, name: str) -> Body | None:
        """The object, or None when it does not exist."""
        try:
            return await self._request("GET", KINDS[kind].path(namespace, name))
        except ApiError as error:
            if error.not_found:
                return None
            raise

    async def list(self, kind: str, namespace: str | None, labels: Mapping[str, str]) -> list[Body]:
        """Every object of `kind` in `namespace` (None: all) carrying all of `labels`."""
        selector = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        items: list[Body] = []
        params = {"labelSelector": selector, "limit": "500"}
        while True:
            page = await self._request("GET", KINDS[kind].path(namespace), params=params)
            for item in page.get("items", []):
                # A list's items carry no apiVersion/kind; callers compare with manifests that do.
                items.append({"apiVersion": _api_version(KINDS[kind]), "kind": kind, **item})
            token = page.get("metadata", {}).get("continue")
            if not token:
                return items
            params = {**params, "continue": token}

    async def create(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> Body:
        """Create `obj` in its namespace; ApiError (already_exists) if the name is taken.
        With `dry_run`, the API server checks it and stores nothing."""
        resource = KINDS[obj["kind"]]
        path = resource.path(obj["metadata"]["namespace"])
        return await self._request("POST", path, params=_write_params(dry_run), json=obj)

    async def patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> Body | None:
        """JSON merge patch (RFC 7386); None when the object is gone. With `dry_run`, the
        API server checks it and changes nothing."""
        path = KINDS[kind].path(namespace, name, subresource)
        try:
            return await self._request(
                "PATCH",
                path,
                # Not the status: an older CRD prunes fields it lacks, as it should.
                params=_write_params(dry_run) if subresource is None else None,
                json=patch,
                content_type="application/merge-patch+json",
            )
        except ApiError as error:
            if error.not_found:
                return None
            raise

    async def patch_status(
        self, kind: str, namespace: str, name: str, status: Mapping[str, Any]
    ) -> Body | None:
        """Merge-patch the status subresource (the main endpoint ignores status)."""
        return await self.patch(kind, namespace, name, {"status": status}, subresource="status")

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete with background propagation (dependents go too); a missing object is fine."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        try:
            await self._request("DELETE", KINDS[kind].path(namespace, name), json=body)
        except ApiError as error:
            if not error.not_found:
                raise

    # ------------------------------------------------------------------ helpers

    async def set_pod_deletion_cost(self, namespace: str, pod: str, cost: int) -> None:
        """Annotate a pod so that a scale-down removes the cheapest pods first."""
        patch = pod_deletion_cost_patch(pod, cost)
        await self.patch("Pod", namespace, pod, {"metadata": patch["metadata"]})

    async def post_event(
        self, involved: Mapping[str, Any], *, reason: str, message: str, warning: bool = False
    ) -> None:
        """A core/v1 Event about `involved`. Best effort: a lost Event never fails a reconcile."""
        meta = involved["metadata"]
        now = _now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                # kubectl's naming: <object>.<unique>; names must be unique per namespace.
                "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": involved["apiVersion"],
                "kind": involved["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": OPERATOR},
            "reportingComponent": OPERATOR,
            "reportingInstance": self._instance or OPERATOR,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.create(event)
        except (ApiError, httpx.HTTPError) as error:
            log.warning("could not post Event %s on %s: %s", reason, meta["name"], error)

    # ------------------------------------------------------------------ transport

    async def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        json: Any = None,
        content_type: str | None = None,
    ) -> Body:
        what = f"{method} {path}"
        delays = self._backoff.delays()
        reauthenticated = False
        while True:
            headers = dict(self._connection.headers())
            if content_type is not None:
                headers["Content-Type"] = content_type
            try:
                response = await self._http().request(
                    method, path, params=params, json=json, headers=headers
                )
            except httpx.TransportError as error:
                failure: Exception = error
                retry_after = None
            else:
                if response.is_success:
                    return response.json() if response.content else {}
                refused = _api_error(response, what)
                if response.status_code == 401 and not reauthenticated:
                    # A rotated service-account token or expired exec credentials.
                    reauthenticated = True
                    self._connection.refresh()
                    continue
                if not refused.retryable:
                    raise refused
                failure, retry_after = refused, _retry_after(response)
            delay = next(delays, None)
            # An ApiError names the request already; a transport error does not.
            why = str(failure) if isinstance(failure, ApiError) else f"{what}: {failure!r}"
            if delay is None:
                log.error("%s; giving up", why)
                raise failure
            if retry_after is not None:
                delay = max(delay, retry_after)
            log.warning("%s; retrying in %.2fs", why, delay)
            await asyncio.sleep(delay)


def _api_error(response: httpx.Response, what: str) -> ApiError:
    """The Status object the API server returns, as an ApiError."""
    try:
        status = response.json()
    except ValueError:
        status = {}
    if not isinstance(status, dict):
        status = {}
    return ApiError(
        response.status_code,
        str(status.get("reason") or response.reason_phrase),
        str(status.get("message") or response.text[:200]),
        what,
    )


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


def _api_version(resource: ApiResource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else resource.version


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
