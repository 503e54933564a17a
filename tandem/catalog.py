"""The model catalog: models a controller serves, even while they have no engine.

The engine registry says which models have live engines; a model scaled to zero
has none, yet a request for it must be queued (not answered 404) so that the
autoscaler sees the work and starts an engine. So whoever runs a model's engines
(the operator, `tandem up -f`) declares it here on every evaluation, and the
gateway accepts a model that is live or declared.

Layout as the registry's: `{prefix}:model:{name}` holds the declaration and
expires `ttl_s` after the last one (a deleted ModelDeployment drops out on its
own), `{prefix}:models` lists the names so readers need no SCAN.
"""

from __future__ import annotations

import json
import time

import redis

from tandem.keys import Keys


def declare(client: redis.Redis, keys: Keys, model: str, owner: str, ttl_s: float) -> None:
    """Declare `model` served by `owner` (e.g. "namespace/name") for the next ttl_s seconds."""
    if not ttl_s > 0:
        raise ValueError(f"a declaration needs a positive TTL, got {ttl_s}")
    body = json.dumps({"model": model, "owner": owner, "declared_at": time.time()})
    pipe = client.pipeline(transaction=False)
    pipe.set(keys.model_key(model), body, px=int(ttl_s * 1000))
    pipe.sadd(keys.models_set, model)
    pipe.execute()


# A declaration outlives a few missed evaluations, and a deleted model is forgotten soon.
MIN_DECLARATION_TTL_S = 60.0


def declaration_ttl_s(interval_s: float) -> float:
    """The TTL for a controller that renews its declarations every interval_s seconds."""
    return max(MIN_DECLARATION_TTL_S, 4 * interval_s)
