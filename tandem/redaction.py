"""Passwords kept out of what Tandem prints: logs, errors, statuses and Events.

A Redis URL carries its password (redis://:pw@host:6379/0). Whatever shows one
(a log line an engine prints while it waits for Redis, which a pod's termination
message and then a ModelDeployment's status quote) shows it as `***` instead.
"""

from __future__ import annotations

import re

# scheme://user:password@ -> scheme://user:***@ (the user may be empty). The password
# runs to the last @ before the host's path: a raw @ in it (p@ss) is all hidden.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*):[^\s/]*@")


def redacted(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***."""
    return _USERINFO.sub(r"\1:***@", text)
