"""Which Redis server (and database) a model's queues are on, as far as its spec says.

Two models share queues when their URLs reach the same server and database, however
each spells it: `tandem-redis.tandem.svc.cluster.local`, `tandem-redis.tandem.svc` and,
from the namespace `tandem`, `tandem-redis` are one Service; a password, `rediss://` or
a trailing dot change nothing. A URL in a Secret (`spec.redis.urlSecretRef`) is not read
here, so such a model is taken to share only with the models of its namespace.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

Body = Mapping[str, Any]
_DEFAULT_PORT = 6379


def redis_server(body: Body, operator_url: str) -> tuple[str, ...]:
    """A key equal for two models exactly when the spec says they use one Redis database
    (without `spec.redis`: the operator's `operator_url`, whose short names resolve
    in the operator's own namespace, which is not known here)."""
    namespace = str(body["metadata"].get("namespace") or "")
    redis = (body.get("spec") or {}).get("redis")
    if not redis:
        return url_server(operator_url, namespace=None)
    url = redis.get("url") if isinstance(redis, Mapping) else None
    if isinstance(url, str):
        return url_server(url, namespace)
    ref = redis.get("urlSecretRef") if isinstance(redis, Mapping) else redis
    return ("secret", namespace, json.dumps(ref, sort_keys=True, default=str))


def url_server(url: str, namespace: str | None) -> tuple[str, ...]:
    """(host, port, database) of a Redis URL, its host as a cluster names it: a short
    Service name is qualified with `namespace`, the one it resolves in (None: kept)."""
    try:
        parts = urlsplit(url)
        port = parts.port or _DEFAULT_PORT
    except ValueError:
        return ("unreadable", url)  # the URL's own check names it; it matches no other
    if parts.scheme == "unix":  # a socket inside the pod: nobody else's
        return ("unix", namespace or "", parts.path)
    host = (parts.hostname or "").lower().rstrip(".").removesuffix(".cluster.local")
    host = host.removesuffix(".svc")
    if namespace is not None and "." not in host and not _is_address(host):
        host = f"{host}.{namespace}"
    # redis-py's order: ?db=N, else the path, else 0.
    database = parse_qs(parts.query).get("db", [parts.path.strip("/") or "0"])[0]
    with contextlib.suppress(ValueError):  # /00 is /0
        database = str(int(database))
    return (host, str(port), database)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
