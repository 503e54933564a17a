"""Which model serves a name: one served name, one model, on one Redis.

Two models of one name on one Redis would both take its queue's work and each scale
on all of it; from two namespaces, one team's pods would read the other's prompts.
A model claims the name its spec asks for and the names its pods serve: the name of
its last applied spec (status.servedModelName) and, while a rename's rollout (or a
mode change) still runs pods of before it, the names those serve
(status.retiringServedModelNames).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from tandem.operator.redis_server import redis_server

Body = Mapping[str, Any]


def served_name_holder(model: Body, models: Sequence[Body], operator_redis: str) -> str | None:
    """The ModelDeployment among `models` (of every namespace served) that holds the
    servedModelName `model` asks for, on the same queues, or None when `model` may serve
    it: "served by ModelDeployment <name>" ("claimed by" while none serves it yet),
    or one of another namespace without naming it (whose models those are is that
    namespace's business).

    The rivals are the models of `model`'s namespace, and those of every namespace
    whose queues are on the same Redis database (redis_server.py: without `spec.redis`,
    the operator's `operator_redis`; a URL naming that Service in full shares it too; a
    short name resolves in its own namespace). A rival claims the name its spec asks for
    (on its spec's Redis) and those its pods serve (`serving_names`: a refused rename
    leaves them serving the old one, a rename's rollout serves both; on the Redis of its
    last applied spec, `status.servedRedis`: a refused move to another Redis leaves them
    on the old one). Of two that claim the name, one whose pods serve it keeps it, else
    the older (by creationTimestamp, then namespace and name): a model that serves a
    name keeps it when another, older or not, is edited to claim it. Read from the raw
    specs: an invalid one may still run pods of its last valid spec. Models being
    deleted let go, and so do those whose current spec was refused and that serve
    nothing (`_claims`).
    """
    name = _asked_name(model)
    namespace = _where(model)[0]
    queues = queues_digest(model, operator_redis)
    # Whether this model's pods serve the name: against its namespace, wherever; against
    # another namespace's models, on these queues.
    held_near = name in serving_names(model)
    held_far = held_near and _serves_on(model, operator_redis) == queues
    winners = []
    for other in models:
        if _where(other) == _where(model) or other["metadata"].get("deletionTimestamp"):
            continue
        # Within a namespace one name is one model whatever the Redis (a URL in a
        # Secret is not read: two could share it unseen).
        near = _where(other)[0] == namespace
        serves = name in serving_names(other) and (
            near or _serves_on(other, operator_redis) == queues
        )
        asks = name == _asked_name(other) and _claims(other)
        if not (serves or (asks and (near or queues_digest(other, operator_redis) == queues))):
            continue
        held = held_near if near else held_far
        if (serves, _age(model)) > (held, _age(other)):
            winners.append((not serves, _age(other), other))
    if not winners:
        return None
    idle, _, holder = min(winners)  # one that serves the name, else the oldest
    how = "claimed by" if idle else "served by"  # an older model yet to serve it
    if _where(holder)[0] == namespace:
        return f"{how} ModelDeployment {_where(holder)[1]}"
    return f"{how} a ModelDeployment of another namespace"


def queues_digest(body: Body, operator_redis: str) -> str:
    """Which Redis database a model's spec puts its queues on, as a digest that says no
    host or password (status.servedRedis)."""
    key = json.dumps(redis_server(body, operator_redis))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def served_queues(body: Body) -> str | None:
    """The queues' digest of a model's last applied spec (None: none recorded, as from
    an operator before it was): where its pods serve, or will once rolled."""
    served = (body.get("status") or {}).get("servedRedis")
    return served if isinstance(served, str) else None


def _serves_on(body: Body, operator_redis: str) -> str:
    """Where a model's pods serve: its last applied spec's queues, else its spec's."""
    return served_queues(body) or queues_digest(body, operator_redis)


# Refusals of a model's own spec (reconcile.py): it applies nothing until edited. Not
# ServedNameTaken: two models waiting for a freed name would each pass the other by.
_REFUSED = ("InvalidSpec", "ChildTaken")


def _claims(body: Body) -> bool:
    """Whether a model claims the name its spec asks for: not when its status refuses
    the spec it has now (a bad spec, a child name another object holds): an older
    model that never served must not keep a valid younger one from the name."""
    status = body.get("status") or {}
    refused = status.get("phase") == "Invalid" and status.get("reason") in _REFUSED
    current = status.get("observedGeneration") == body["metadata"].get("generation")
    return not (refused and current)


def _asked_name(body: Body) -> str:
    """The name a model's spec asks to serve: its servedModelName, else its own."""
    source = (body.get("spec") or {}).get("model")
    chosen = source.get("servedModelName") if isinstance(source, Mapping) else None
    return chosen if isinstance(chosen, str) and chosen else body["metadata"]["name"]


def applied_name(body: Body) -> str | None:
    """The name of a model's last applied spec, as its status recorded it (None: none
    recorded): what its pods serve, or will once rolled."""
    return _applied(body.get("status") or {})


def serving_names(body: Body) -> set[str]:
    """Every name a model's pods may serve now: the applied one, and those of pods from
    before a rename that serve on until replaced."""
    return _status_names(body.get("status") or {})


def retiring_names(previous: Body, applied: str) -> tuple[str, ...]:
    """The names pods of before the spec named `applied` may still serve, from the last
    status `previous`: its applied name and retiring ones, less `applied` (a rename back)."""
    return tuple(sorted(_status_names(previous) - {applied}))


def _applied(status: Body) -> str | None:
    served = status.get("servedModelName")
    return served if isinstance(served, str) else None


def _status_names(status: Body) -> set[str]:
    retiring = status.get("retiringServedModelNames")
    names = {n for n in retiring if isinstance(n, str)} if isinstance(retiring, list) else set()
    applied = _applied(status)
    return names | {applied} if applied is not None else names


def _where(body: Body) -> tuple[str, str]:
    meta = body["metadata"]
    return (str(meta.get("namespace") or ""), meta["name"])


def _age(body: Body) -> tuple[str, str, str]:
    return (str(body["metadata"].get("creationTimestamp") or ""), *_where(body))
