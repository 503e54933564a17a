"""The run folder of one `tandem up`: its children's logs and its Redis' data."""

from __future__ import annotations

import fcntl
import tempfile
from pathlib import Path
from typing import IO

LOCK_FILE = ".tandem-up.lock"


def claim_run_folder(folder: Path) -> IO[bytes]:
    """Make `folder`, check it takes files, and hold it for this stack's life: the open
    lock file, closed at stop. ValueError, saying why, where it cannot be had.

    Two stacks in one folder ran their Redis on one append-only file, and one's
    restarted Redis loaded the other's data; a folder it could not write to failed
    later, with a traceback, as Redis started.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
        lock = open(folder / LOCK_FILE, "wb")  # noqa: SIM115 (held until stop)
    except OSError as exc:
        raise ValueError(f"cannot create or write to --log-dir {folder}: {exc.strerror}") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(
            f"--log-dir {folder} is in use by another running `tandem up`: give each its own"
        ) from None
    return lock


def remove_if_unused(folder: Path) -> None:
    """Remove a run folder that holds nothing but its lock file (its stack stopped)."""
    if {p.name for p in folder.iterdir()} <= {LOCK_FILE}:
        (folder / LOCK_FILE).unlink(missing_ok=True)
        folder.rmdir()
