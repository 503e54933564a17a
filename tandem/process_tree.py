"""The processes under a process, and whether one still runs, from Linux's /proc
(elsewhere: none, and not running)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes `pid` started that are still its own (those of every thread)."""
    found: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(child) for child in listing.read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    """Its children, theirs, and so on."""
    found: list[int] = []
    todo = children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children(child)
    return found


def running(pid: int) -> bool:
    """Whether `pid` runs: a zombie has exited, its parent (init, once orphaned) not yet
    told."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
