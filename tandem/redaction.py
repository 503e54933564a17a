"""Passwords kept out of what Tandem prints: logs, errors, statuses and Events.

A Redis URL carries its password (redis://:pw@host:6379/0). Whatever shows one
(a log line an engine prints while it waits for Redis, which a pod's termination
message and then a ModelDeployment's status quote) shows it as `***` instead.
"""

from __future__ import annotations

import inspect
import re
from typing import Any
from urllib.parse import urlsplit

# scheme://user:password@ -> scheme://user:***@ (the user may be empty). The password
# runs to the URL's last @: a raw @, / or ? in it (p@ss, a base64 password) all hidden.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*):\S*@")
# scheme://secret@: a password given where the user goes (no colon) is shown as
# neither, as redis-py would send it as neither.
_USER_ONLY = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+@")
# ...?password=pw: redis-py reads it there too (the usual form for a unix:// socket), and
# a TLS key's passphrase as ssl_password.
_QUERY_PASSWORD = re.compile(r"(?i)([?&](?:ssl_)?password=)[^&#\s]*")

REDIS_URL_FORMS = (
    "redis://[[user]:password@]host[:port][/db], rediss://... or unix://path; "
    "percent-encode any /, ?, # or @ in the password"
)


def redacted(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***."""
    text = _USER_ONLY.sub(r"\1***@", _USERINFO.sub(r"\1:***@", text))
    return _QUERY_PASSWORD.sub(r"\1***", text)


def check_redis_url(url: str, where: str) -> None:
    """ValueError unless redis-py reads `url` as it was meant, naming `where` (a flag, a
    field) and never the URL or redis-py's reason, which quotes pieces of it: a password
    holding a / reads as host:port, its first half as the port ("cannot be cast ... as
    'pw'"); one holding a ? or # followed by digits read as a port, and the client
    dialled another server; a query parameter it does not know failed every connection
    with a TypeError."""
    import redis.asyncio.connection
    from redis.connection import Connection, parse_url

    not_redis = ValueError(f"{where} is not a Redis URL: {REDIS_URL_FORMS}")
    parts = urlsplit(url)
    if "#" in url or "@" in parts.path + parts.query:  # a password's ? or # read as its end
        raise not_redis
    try:
        options = parse_url(url)
    except ValueError:
        raise not_redis from None
    kind = options.pop("connection_class", Connection)
    if kind is Connection and not options.get("host"):
        raise not_redis
    # What both the engines' (sync) and the gateway's (asyncio) clients take: the
    # asyncio TLS connection lacks the OCSP options, and failed every call on them.
    twin = getattr(redis.asyncio.connection, kind.__name__)
    known = {"max_connections"} | (_parameters(kind) & _parameters(twin))
    if unknown := sorted(set(options) - known):
        tls = " (TLS is a rediss:// URL)" if "ssl" in unknown else ""
        raise ValueError(
            f"{where}: not every Redis client of Tandem takes the connection option "
            f"{', '.join(unknown)} (a query parameter of the URL){tls}: {REDIS_URL_FORMS}"
        )


def _parameters(kind: type) -> set[str]:
    """The named parameters of a connection class's __init__ and its bases'."""
    names = set()
    for cls in kind.__mro__:
        if (init := cls.__dict__.get("__init__")) is not None:
            names |= set(inspect.signature(init).parameters)
    return names - {"self", "args", "kwargs"}


def password_given(client: Any) -> bool:
    """Whether a redis-py client (sync or asyncio) sends a password: its URL's, or a
    ?password= one."""
    return client.connection_pool.connection_kwargs.get("password") is not None


def refused_credentials(password_given: bool) -> str:
    """What Redis's refusal of a client's credentials means, in words a user acts on
    (redis-py's, with no password given: "HELLO must be called with the client already
    authenticated ...")."""
    # In a pod the URL is $TANDEM_REDIS_URL's (the chart's, the operator's): no flag.
    if password_given:
        return "refused the password of --redis-url ($TANDEM_REDIS_URL)"
    return "asks for a password, and none is in --redis-url ($TANDEM_REDIS_URL)"
