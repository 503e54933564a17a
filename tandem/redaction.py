"""Passwords kept out of what Tandem prints: logs, errors, statuses and Events.

A Redis URL carries its password (redis://:pw@host:6379/0). Whatever shows one
(a log line an engine prints while it waits for Redis, which a pod's termination
message and then a ModelDeployment's status quote) shows it as `***` instead.
"""

from __future__ import annotations

import re
from typing import Any

# scheme://user:password@ -> scheme://user:***@ (the user may be empty). The password
# runs to the URL's last @: a raw @, / or ? in it (p@ss, a base64 password) all hidden.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*):\S*@")
# ...?password=pw: redis-py reads it there too (the usual form for a unix:// socket).
_QUERY_PASSWORD = re.compile(r"(?i)([?&]password=)[^&#\s]*")

REDIS_URL_FORMS = (
    "redis://[[user]:password@]host[:port][/db], rediss://... or unix://path; "
    "percent-encode any /, ?, # or @ in the password"
)


def redacted(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***."""
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO.sub(r"\1:***@", text))


def check_redis_url(url: str, where: str) -> None:
    """ValueError unless redis-py reads `url`, naming `where` (a flag, a field) and never
    the URL or redis-py's reason, which quotes pieces of it: a password holding a /
    reads as host:port, its first half as the port ("cannot be cast ... as 'pw'")."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError:
        raise ValueError(f"{where} is not a Redis URL: {REDIS_URL_FORMS}") from None


def password_given(client: Any) -> bool:
    """Whether a redis-py client (sync or asyncio) sends a password: its URL's, or a
    ?password= one."""
    return client.connection_pool.connection_kwargs.get("password") is not None


def refused_credentials(password_given: bool) -> str:
    """What Redis's refusal of a client's credentials means, in words a user acts on
    (redis-py's, with no password given: "HELLO must be called with the client already
    authenticated ...")."""
    if password_given:
        return "refused the password of --redis-url"
    return "asks for a password, and none is in --redis-url"
