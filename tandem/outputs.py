"""Output paths of `tandem bench` and `tandem sim`, checked before the run they would hold.

A run may take hours; a typo in `--json` or `--plots` found only once it is
over loses the result. So each path is checked first (a ValueError naming
the flag: exit 2), without creating anything: missing folders are created
when the output is written. A write that still fails after the run (a full
disk) is reported by `write_failed` once the text report is out.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def check_file(flag: str, path: str | Path) -> None:
    """`path` can be written as a file (it or its nearest existing folder is writable)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise ValueError(f"{flag} {path}: is a folder, not a file")
        if path.exists():
            open(path, "ab").close()  # appending nothing leaves the file as it was
        else:
            _check_writable_folder(flag, path, path.parent)
    except OSError as exc:
        raise ValueError(cannot_write(flag, path, exc)) from None


def check_dir(flag: str, path: str | Path) -> None:
    """`path` can be a folder to write files into (existing or not)."""
    path = Path(path)
    try:
        _check_writable_folder(flag, path, path)
    except OSError as exc:
        raise ValueError(cannot_write(flag, path, exc)) from None


def say(text: str) -> None:
    """Print to stdout, which the reader may have closed (`| head`): what is still to
    write (--json, the plots) is written all the same, and no write to a closed pipe
    reads as one of theirs failing."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Later prints and the flush at exit go to /dev/null and pass.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def write_failed(flag: str, path: str | Path, exc: OSError) -> None:
    """Say, after the run, which output could not be written (the caller goes on)."""
    print(f"tandem: error: {cannot_write(flag, path, exc)}", file=sys.stderr)


def cannot_write(flag: str, path: str | Path, exc: OSError) -> str:
    return f"{flag} {path}: cannot write ({exc.strerror or str(exc) or type(exc).__name__})"


def _check_writable_folder(flag: str, path: Path, folder: Path) -> None:
    # The nearest folder that exists: the one the missing ones would be created in.
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        which = "" if existing == path else f"{existing} "
        raise ValueError(f"{flag} {path}: {which}is not a folder")
    # A file that vanishes on close: the only sure test (permissions, read-only mounts, /proc).
    with tempfile.TemporaryFile(dir=existing):
        pass
