"""The cancel notice, as the gateway writes it and engines read it (docs/protocol.md).

A key with a TTL answers "was this cancelled?" at any time; a PUBLISH reaches the
engines already running the request within milliseconds. Both go in one MULTI,
so a listener told of the cancellation always finds the key too. The commands
are queued on the caller's pipeline (sync or asyncio), which executes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tandem.keys import Keys
from tandem.protocol import CANCEL_TTL_SECONDS


def cancel_commands(pipe: Any, keys: Keys, request_ids: Iterable[str]) -> None:
    """Queue the notice of each request on `pipe` (a transaction); the PUBLISH replies
    are how many listeners heard each."""
    for request_id in request_ids:
        if not request_id:
            raise ValueError("request_id must be non-empty")
        pipe.set(keys.cancel_key(request_id), "1", ex=CANCEL_TTL_SECONDS)
        pipe.publish(keys.cancel_channel, request_id)
