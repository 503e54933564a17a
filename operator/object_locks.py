"""One asyncio lock per ModelDeployment, kept while a pass holds or waits for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable


class ObjectLocks:
    """Passes of one object never overlap; an object nobody holds costs nothing.

    A lock is dropped when its last holder or waiter leaves, never from outside: a
    lock dropped while a pass held it (the object deleted meanwhile) let the next
    pass, of a new object of the same name, make a second one and run beside it.
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[asyncio.Lock, int]] = {}  # lock, users

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._entries.get(key, (None, 0))
        lock = lock or asyncio.Lock()
        self._entries[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._entries[key]
            if users == 1:
                del self._entries[key]
            else:
                self._entries[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._entries)
