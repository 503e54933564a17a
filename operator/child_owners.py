"""Whose a child's name is: the operator adopts what no other controller owns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.operator.spec import KIND

Body = Mapping[str, Any]


def check_not_taken(manifest: Body, existing: Body) -> None:
    """ChildTaken if another controller owns the object of the child's name."""
    meta = manifest["metadata"]
    ours = meta["ownerReferences"][0]
    owners = existing["metadata"].get("ownerReferences") or []
    other = [o for o in owners if o.get("controller") and o.get("uid") != ours["uid"]]
    # An earlier ModelDeployment of the same name (deleted and made again before the
    # garbage collector came) owned it: ours now.
    other = [o for o in other if o.get("kind") != KIND or o.get("name") != ours["name"]]
    if other:
        raise ChildTaken(
            f"{manifest['kind']} {meta['name']} exists and belongs to "
            f"{other[0].get('kind')} {other[0].get('name')}: rename or delete it"
        )


class ChildTaken(Exception):
    """A child's name is held by an object another controller owns."""
