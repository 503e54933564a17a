"""Whether Redis still holds the data an engine saw: its epoch key.

An entry this engine holds can vanish from the group's pending list in two ways:
another engine took it over and finished it (it acknowledges, so deletes, the
entry), or Redis lost its data (restarted without persistence, a FLUSHALL). The
first is common after a long stall; the second leaves nobody else to serve the
request, so the engine goes on with it. The pending list cannot tell them apart,
nor can the request's response stream, which expires a minute after its answer
was delivered: an engine back from a two-minute freeze ran a request already
answered elsewhere to its end, for nobody.

The epoch key tells: the first engine to look sets it (SET NX) to a random value
and none ever changes it, so while it reads as it did at the engine's start,
Redis has lost nothing since; a Redis that lost its data lost the key with it.
After such a loss the engine goes back to the response stream alone, until it
restarts.
"""

from __future__ import annotations

import secrets

import redis

from tandem.keys import Keys
from tandem.protocol import as_text


class DataEpoch:
    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._client = client
        self._key = keys.data_epoch
        self._seen: str | None = None  # as noted at the engine's start; None: not noted

    def note(self) -> None:
        """Read it now (the engine's start): what later reads are compared with."""
        self._seen = self._read()

    @property
    def noted(self) -> bool:
        return self._seen is not None

    def kept(self) -> bool:
        """Whether Redis kept its data since it was noted (the engine's start, or its
        first pull where Redis was away at the start). Not noted: not known, so not
        kept. Once it reads otherwise it stays so: the entries this engine held when
        Redis lost them are gone for good, and read against the new epoch they would
        pass for finished elsewhere (their final events dropped, their clients left
        waiting)."""
        return self._seen is not None and self._read() == self._seen

    def _read(self) -> str:
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._key, secrets.token_hex(8), nx=True)
        pipe.get(self._key)
        _, value = pipe.execute()
        return "" if value is None else as_text(value)
