"""The emulated API server's objects: what the Kubernetes API does with every write.

kmock's KubernetesEmulator keeps objects as plain dicts and merges patches
into them. ApiStore adds what the API server does on a write (kube_api.py is
the HTTP side and lists every gap filled):

- metadata: uid, resourceVersion (one counter), creationTimestamp,
  generateName; generation bumps on changes outside metadata and status;
  a write that changes nothing changes no resourceVersion and sends no event;
- status isolation: for resources with a status subresource the main
  endpoint ignores status and /status changes only status;
- JSON merge patches and JSON patches ('test' failures are 422, as kopf
  expects); resourceVersion preconditions (409 Conflict); deletion with
  finalizers (deletionTimestamp, then removal when the last finalizer goes);
- admission of ModelDeployments with the CRD's schema (support.crd_schema:
  defaults, strict fields, OpenAPI, CEL), status checked against the status
  schema, spec errors ratcheted (an unchanged spec is not checked again);
  `admission=False` (or `admit=False` per write) stores what it is given, as
  a cluster without the CRD's rules would;
- fieldValidation=Strict on writes of built-in kinds: an unknown field is a
  400 naming it (kubernetes-validate's schemas; the default, Warn, is not
  emulated: the field is kept, where a real server drops it);
- dryRun=All on creates and patches: every check made, nothing stored;
- mutating admission webhooks (`webhooks`), run on creates and patches;
- garbage collection: removing an owner removes its dependents (background
  propagation), as kube-controller-manager does.

The Deployment stand-in and the tests write through the same paths
(`create`, `patch`, `delete`), so they see the same events kopf sees.
"""

from __future__ import annotations

import copy
import datetime
import re
import secrets
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import jsonpatch
import kmock
from kmock._internal import dicts

from support.crd_schema import api_server_errors, with_defaults
from support.manifest_schemas import unknown_fields

Body = dict[str, Any]
MODELS = kmock.resource("serving.tandem.dev", "v1alpha1", "modeldeployments")
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
PODS = kmock.resource("", "v1", "pods")
EVENTS = kmock.resource("", "v1", "events")
NAMESPACES = kmock.resource("", "v1", "namespaces")
PEERINGS = kmock.resource("kopf.dev", "v1", "kopfpeerings")
CLUSTER_PEERINGS = kmock.resource("kopf.dev", "v1", "clusterkopfpeerings")
SECRETS = kmock.resource("", "v1", "secrets")
CHILDREN = {
    "ConfigMap": kmock.resource("", "v1", "configmaps"),
    "Secret": SECRETS,
    "Service": kmock.resource("", "v1", "services"),
    "Deployment": DEPLOYMENTS,
    "PodDisruptionBudget": kmock.resource("policy", "v1", "poddisruptionbudgets"),
}
_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
# Called after every committed change: (resource, event type, object).
Listener = Callable[[kmock.resource, str, Body], None]


class ApiError(kmock.KubernetesError):
    """An API server refusal, rendered as a Status object (code, reason, message)."""


@attrs.define(kw_only=True)
class ApiStore(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the API server's write semantics (module docstring)."""

    # The ModelDeployment CRD's openAPIV3Schema.
    crd_schema: Mapping[str, Any]
    admission: bool = True
    # Mutating admission webhooks by resource: each edits, in place, what a create or a
    # patch (not of the status) would store, as Kyverno's policies do.
    webhooks: dict[kmock.resource, Callable[[Body], None]] = attrs.field(factory=dict)
    _rv: int = attrs.field(default=0, init=False)
    _listeners: list[Listener] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock reads its bundle with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()  # the built-in kinds of a recent cluster (K3s)
        self.resources[MODELS] = kmock.ResourceInfo(
            kind="ModelDeployment",
            singular="modeldeployment",
            namespaced=True,
            shortnames={"md"},
            categories={"tandem"},
            verbs=_VERBS,
            subresources={"status"},
        )
        for resource, kind in ((PEERINGS, "KopfPeering"), (CLUSTER_PEERINGS, "ClusterKopfPeering")):
            self.resources[resource] = kmock.ResourceInfo(
                kind=kind, singular=kind.lower(), namespaced=resource == PEERINGS, verbs=_VERBS
            )

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def read(self, resource: kmock.resource, namespace: str | None, name: str) -> Body | None:
        """The stored object (a copy), or None."""
        key = (resource, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def select(
        self, resource: kmock.resource, namespace: str | None = None, selector: str = ""
    ) -> list[Body]:
        """Copies of the objects in `namespace` (None: all) matching the label selector."""
        return [copy.deepcopy(obj) for obj in self._matching(resource, namespace, selector)]

    async def create(
        self,
        resource: kmock.resource,
        namespace: str | None,
        body: Mapping[str, Any],
        *,
        admit: bool | None = None,
    ) -> Body:
        async with self._lock:
            return await self._create(resource, namespace, body, self._admits(admit))

    async def patch(
        self,
        resource: kmock.resource,
        namespace: str | None,
        name: str,
        patch: Any,
        *,
        subresource: str | None = None,
        admit: bool | None = None,
    ) -> Body:
        async with self._lock:
            admits = self._admits(admit)
            return await self._patch(resource, namespace, name, patch, subresource, admits)

    async def delete(self, resource: kmock.resource, namespace: str | None, name: str) -> Body:
        async with self._lock:
            return await self._delete(resource, namespace, name)

    # ------------------------------------------------------------------ writes (under the lock)

    def _admits(self, admit: bool | None) -> bool:
        return self.admission if admit is None else admit

    async def _create(
        self,
        resource: kmock.resource,
        namespace: str | None,
        body: Mapping[str, Any],
        admit: bool,
        strict: bool = False,
        dry_run: bool = False,
    ) -> Body:
        obj = copy.deepcopy(dict(body))
        # The server names the type of what it stores, as the URL says, when a body did not.
        group_version = f"{resource.group}/{resource.version}".lstrip("/")
        obj.setdefault("apiVersion", group_version)
        obj.setdefault("kind", self.resources[resource].kind)
        meta = obj.setdefault("metadata", {})
        namespaced = bool(self.resources[resource].namespaced)
        namespace = (namespace or meta.get("namespace")) if namespaced else None
        if namespaced and meta.get("namespace", namespace) != namespace:
            raise ApiError(400, "BadRequest", "the namespace of the object does not match the URL")
        name = meta.get("name") or (meta.get("generateName", "") + secrets.token_hex(3)[:5])
        if not name:
            raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
        if self.read(resource, namespace, name) is not None:
            raise ApiError(409, "AlreadyExists", f'{resource.plural} "{name}" already exists')
        if "status" in self.resources[resource].subresources:
            obj.pop("status", None)
        for key in ("uid", "resourceVersion", "deletionTimestamp", "generation"):
            meta.pop(key, None)
        if namespace is not None:
            meta["namespace"] = namespace
        meta.update(name=name, uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        if resource == MODELS and admit:
            obj = self._admit(obj, name)
        if (webhook := self.webhooks.get(resource)) is not None:
            webhook(obj)
        if strict:
            _strict_decode(obj)
        if dry_run:  # dryRun=All: every check made, nothing stored
            return obj
        return await self._commit(resource, "ADDED", obj)

    async def _patch(
        self,
        resource: kmock.resource,
        namespace: str | None,
        name: str,
        patch: Any,
        subresource: str | None,
        admit: bool,
        strict: bool = False,
        dry_run: bool = False,
    ) -> Body:
        current = self.read(resource, namespace, name)
        if current is None or subresource not in (None, "status"):
            raise not_found(resource, name)
        try:
            if isinstance(patch, list):
                patched = jsonpatch.apply_patch(current, patch, in_place=False)
            else:
                patched = dicts.merge_patch_dict(current, patch or {})
        except jsonpatch.JsonPatchTestFailed as error:
            raise ApiError(422, "Invalid", f"the patch's test failed: {error}") from None
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, ValueError) as e:
            raise ApiError(422, "Invalid", f"the patch cannot be applied: {e}") from None
        patched = copy.deepcopy(dict(patched))
        old_meta = current["metadata"]
        wanted = (
            patch.get("metadata", {}).get("resourceVersion") if isinstance(patch, dict) else None
        )
        if wanted is not None and wanted != old_meta["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                "the object has been modified; apply your changes to the latest version "
                "and try again",
            )
        fixed = ("name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation")
        meta = patched.setdefault("metadata", {})
        for key in (*fixed, "deletionTimestamp"):
            if key in old_meta:
                meta[key] = old_meta[key]
        if subresource == "status":
            patched = {**current, "status": patched.get("status")}
        elif "status" in self.resources[resource].subresources:
            patched.pop("status", None)
            if "status" in current:
                patched["status"] = current["status"]
        if resource == MODELS and admit:
            patched = self._admit(patched, name, current, status_only=subresource == "status")
        if subresource is None and (webhook := self.webhooks.get(resource)) is not None:
            webhook(patched)
        meta = patched["metadata"]  # admission returns a new object
        if _spec_of(patched) != _spec_of(current):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if strict and subresource is None:
            _strict_decode(patched)
        if patched == current or dry_run:
            return patched  # no change: no new resourceVersion, no event
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return await self._remove(resource, patched)
        return await self._commit(resource, "MODIFIED", patched)

    async def _delete(self, resource: kmock.resource, namespace: str | None, name: str) -> Body:
        current = self.read(resource, namespace, name)
        if current is None:
            raise not_found(resource, name)
        meta = current["metadata"]
        if not meta.get("finalizers"):
            return await self._remove(resource, current)
        if meta.get("deletionTimestamp"):
            return current
        meta["deletionTimestamp"] = _now()
        meta["generation"] = int(meta.get("generation", 1)) + 1
        return await self._commit(resource, "MODIFIED", current)

    async def _remove(self, resource: kmock.resource, obj: Body) -> Body:
        meta = obj["metadata"]
        self.objects[resource, meta.get("namespace"), meta["name"]].delete()
        await self._announce(resource, "DELETED", obj)
        # Garbage collection, background propagation: the owner is gone, its dependents go.
        for (kind, namespace, name), stored in list(self.objects.items()):
            if stored.deleted or namespace != meta.get("namespace"):
                continue
            owners = stored.raw.get("metadata", {}).get("ownerReferences") or []
            if any(owner.get("uid") == meta["uid"] for owner in owners):
                await self._delete(kind, namespace, name)
        return obj

    async def _commit(self, resource: kmock.resource, kind: str, obj: Body) -> Body:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (resource, obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in self.objects:
            self.objects[key].history.append(copy.deepcopy(obj))
        else:
            self.objects[key] = copy.deepcopy(obj)
        await self._announce(resource, kind, obj)
        return copy.deepcopy(obj)

    async def _announce(self, resource: kmock.resource, kind: str, obj: Body) -> None:
        await self._buses[resource].put({"type": kind, "object": copy.deepcopy(obj)})
        for listener in self._listeners:
            listener(resource, kind, copy.deepcopy(obj))

    def _admit(
        self, obj: Body, name: str, current: Body | None = None, *, status_only: bool = False
    ) -> Body:
        """The CRD's defaults and checks; a spec that did not change is not checked again."""
        if status_only:
            schema = self.crd_schema["properties"]["status"]
            errors = [f"status.{e}" for e in api_server_errors(schema, obj.get("status") or {})]
        else:
            obj = with_defaults(self.crd_schema, obj)
            unchanged = current is not None and _spec_of(obj) == _spec_of(current)
            errors = [] if unchanged else api_server_errors(self.crd_schema, obj)
        if errors:
            raise ApiError(
                422,
                "Invalid",
                f'ModelDeployment.serving.tandem.dev "{name}" is invalid: {"; ".join(errors)}',
            )
        return obj

    def _matching(
        self, resource: kmock.resource, namespace: str | None, selector: str
    ) -> Iterator[Body]:
        for (stored_resource, stored_ns, _), stored in self.objects.items():
            if stored_resource != resource or stored.deleted:
                continue
            if namespace is not None and stored_ns != namespace:
                continue
            obj = stored.raw
            if selector_matches(selector, obj.get("metadata", {}).get("labels") or {}):
                yield obj


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Kubernetes label selector syntax: a=b, a==b, a!=b, a in (x,y), a notin (x), a, !a."""
    for requirement in re.split(r",(?![^()]*\))", selector):
        text = requirement.strip()
        if not text:
            continue
        if match := re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", text):
            values = {v.strip() for v in match[3].split(",")}
            if (labels.get(match[1]) in values) != (match[2] == "in"):
                return False
        elif "!=" in text:
            key, value = (part.strip() for part in text.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in text:
            key, value = (part.strip() for part in re.split(r"==?", text, maxsplit=1))
            if labels.get(key) != value:
                return False
        elif text.startswith("!"):
            if text[1:].strip() in labels:
                return False
        elif text not in labels:
            return False
    return True


def not_found(resource: kmock.resource, name: str | None) -> ApiError:
    return ApiError(404, "NotFound", f'{resource.plural} "{name}" not found')


def _spec_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What metadata.generation tracks: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _strict_decode(obj: Body) -> None:
    """fieldValidation=Strict: a built-in object with a field its kind does not define
    is refused (the default, Warn, drops the field with a warning header)."""
    unknown = unknown_fields(obj)
    if unknown:
        kind, version = obj["kind"], obj["apiVersion"].rpartition("/")[2]
        fields = ", ".join(f'unknown field "{field}"' for field in unknown)
        raise ApiError(
            400,
            "BadRequest",
            f'{kind} in version "{version}" cannot be handled as a {kind}: '
            f"strict decoding error: {fields}",
        )
