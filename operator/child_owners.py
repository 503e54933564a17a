"""Whose a child's name is: the operator adopts only what is already the model's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.operator.spec import KIND

Body = Mapping[str, Any]

# The labels every child carries that say whose it is (manifests.labels): the object
# of a child's name that has them is the model's own, whatever else was edited away.
_OURS_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance")


def check_not_taken(manifest: Body, existing: Body) -> None:
    """ChildTaken unless the object of the child's name is the model's to adopt: one an
    owner reference gives to a ModelDeployment of its name (this one, or an earlier one
    deleted and made again before the garbage collector came), or one with the model's
    labels and no other controller (orphaned by `kubectl delete --cascade=orphan`, its
    references cut). Anything else is someone else's (a team's own Service, made by
    kubectl or Helm): adopted, it was overwritten, and deleted with the model."""
    meta = manifest["metadata"]
    ours = meta["ownerReferences"][0]
    owners = existing["metadata"].get("ownerReferences") or []
    models = [o for o in owners if o.get("kind") == KIND and o.get("name") == ours["name"]]
    other = [o for o in owners if o.get("controller") and o not in models]
    if other:
        raise ChildTaken(
            f"{manifest['kind']} {meta['name']} exists and belongs to "
            f"{other[0].get('kind')} {other[0].get('name')}: rename or delete it"
        )
    labels = existing["metadata"].get("labels") or {}
    labelled = all(labels.get(key) == meta["labels"].get(key) for key in _OURS_LABELS)
    if not (models or labelled):
        raise ChildTaken(
            f"{manifest['kind']} {meta['name']} exists and is not this ModelDeployment's "
            "(no owner reference to it, nor its labels): rename or delete it"
        )


class ChildTaken(Exception):
    """A child's name is held by an object another controller owns, or nobody's."""
