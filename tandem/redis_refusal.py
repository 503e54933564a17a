"""A Redis that answers but refuses a command for a while, told from a bug.

A full Redis (maxmemory with noeviction, the chart's setting: it refuses new
work rather than lose accepted work), a failed save (MISCONF), a replica
(READONLY), a replica cut off from its master, a Redis loading its file, a
script running long (BUSY): each refuses commands until an operator or time
fixes it. Engines wait these out as
they wait out an absent Redis; the gateway says which it is.
"""

from __future__ import annotations

import re

import redis

_CODES = {
    "OOM": "Redis is full (maxmemory) and takes no new writes",
    "MISCONF": "Redis refuses writes since its last save failed (MISCONF)",
    "READONLY": "Redis is a read-only replica",
    "LOADING": "Redis is loading its data",
    "MASTERDOWN": "Redis is a replica whose master is down",
    "NOREPLICAS": "Redis has too few replicas to take writes",
    # A script running past lua-time-limit: Redis answers nothing else until it ends.
    "BUSY": "Redis is busy running a script",
}
_CODE = re.compile(rf"\b({'|'.join(_CODES)})\b")
# How redis.call() errors come out of a Lua script: the script's name and line first.
_SCRIPT = re.compile(r"^Error running script \(call to \w+\): @user_script:\d+: -?")


def refusal(exc: BaseException) -> str | None:
    """What a refusal means in words (None: not a refusal)."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return _CODES["OOM"]
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return _CODES["READONLY"]
    if isinstance(exc, redis.ResponseError) and (found := _CODE.search(str(exc))):
        return _CODES[found.group(1)]
    return None


def plain(exc: BaseException) -> str:
    """The error's text without a Lua script's internals."""
    return _SCRIPT.sub("", str(exc))
