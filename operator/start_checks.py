"""What the operator checks as it starts: objects of the cluster it cannot serve without.

Each missing one is said in one line (`tandem operator: ...`, exit 2) rather than
left to show as an operator that does nothing (kopf paused for a missing peering) or
as statuses the API server cuts (a CRD older than the operator). What cannot be read
(RBAC of another shape, an API server out of reach) leaves a check undone: kopf goes
on to say what it finds.
"""

from __future__ import annotations

import logging

import httpx

from tandem.operator import crd
from tandem.operator.kube import ApiError, KubeApi
from tandem.operator.settings import OperatorSettings
from tandem.operator.spec import VERSION

log = logging.getLogger(__name__)


class CannotServe(RuntimeError):
    """What the cluster lacks for this operator to serve: said in one line, exit 2."""


class MissingPeering(CannotServe):
    """A peering object the operator's replicas would share is not there."""


async def check_crd(kube: KubeApi) -> None:
    """CannotServe if the ModelDeployment CRD served is older than this operator: the API
    server drops the status fields its schema lacks, and the status written each pass
    never read back as written (a rewrite at every pass; a rename's guard, the names
    its old pods still serve, lost). Not checked where CRDs may not be listed."""
    try:
        crds = await kube.list("CustomResourceDefinition", None, {})
    except (ApiError, httpx.HTTPError, OSError) as error:
        log.warning("could not check the ModelDeployment CRD's version: %s", error)
        return
    ours = crd.custom_resource_definition()
    for live in crds:
        if live["metadata"]["name"] != ours["metadata"]["name"]:
            continue
        for version in live["spec"].get("versions") or []:
            if version.get("name") != VERSION:
                continue
            root = (version.get("schema") or {}).get("openAPIV3Schema") or {}
            status = (root.get("properties") or {}).get("status") or {}
            missing = sorted(
                set(crd.status_schema()["properties"]) - set(status.get("properties") or {})
            )
            # Condition types its enum lacks: the API server refuses every status written.
            allowed = _condition_types(status)
            if allowed is not None:
                ours = _condition_types(crd.status_schema()) or []
                missing += [f"{kind} condition" for kind in ours if kind not in allowed]
            if missing:
                raise CannotServe(
                    f"the ModelDeployment CRD is older than this operator: its status has no "
                    f"{', '.join(missing)}, which the API server would drop from every status "
                    "written, or refuse it; upgrade the CRDs first (the tandem-crds chart, or "
                    "kubectl apply -f crds/modeldeployment.yaml)"
                )


def _condition_types(status: dict) -> list[str] | None:
    """The condition types a status schema's enum allows; None: any (no enum)."""
    conditions = (status.get("properties") or {}).get("conditions") or {}
    kind = ((conditions.get("items") or {}).get("properties") or {}).get("type") or {}
    return kind.get("enum")


async def check_peerings(kube: KubeApi, settings: OperatorSettings) -> None:
    """MissingPeering unless the peering object of every namespace served (or the cluster's)
    exists: kopf pauses the operator while one is missing, in every namespace, and said
    only that it resumed (a served namespace made again after the chart's install has
    none). A listing refused (RBAC of another shape) or an API server out of reach
    leaves the check undone (kopf goes on to say what it finds)."""
    if settings.standalone:
        return
    name = settings.peering_name
    wanted = (
        {"ClusterKopfPeering": [None]}
        if settings.clusterwide
        else {"KopfPeering": list(settings.namespaces)}
    )
    missing = []
    for kind, namespaces in wanted.items():
        for namespace in namespaces:
            try:
                found = await kube.list(kind, namespace, {})
            except (ApiError, httpx.HTTPError, OSError) as error:  # kopf says the rest
                log.warning("could not check the %s %r: %s", kind, name, error)
                return
            if name not in {item["metadata"]["name"] for item in found}:
                missing.append(f"{kind} {name!r}" + (f" in {namespace}" if namespace else ""))
    if missing:
        raise MissingPeering(
            f"no {', no '.join(missing)}: kopf pauses the operator in every namespace while "
            "a peering it shares is missing; create it (kubectl apply of a KopfPeering of "
            "that name, as the chart makes one per namespace served), or run --standalone "
            "with one replica"
        )
