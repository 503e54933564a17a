"""`eventually`: wait for a condition that another process or thread makes true."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(check: Callable[[], object], timeout: float = 15.0, interval: float = 0.05) -> bool:
    """Whether check() came true within timeout seconds (an engine frees KV after the
    cancel arrives, a gateway counts a request just after its last byte went out);
    callers assert it, so a failure names their condition."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
