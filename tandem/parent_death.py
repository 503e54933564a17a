"""Child processes that die with the process that started them, as a pod's container
takes every process in it down.

A supervisor killed outright (SIGKILL, an OOM kill) forwards nothing: its children,
orphaned, went on serving, holding their ports and their KV, and the next `tandem up`
on that port failed. Linux asks the kernel to SIGKILL the child when the thread that
started it exits (PR_SET_PDEATHSIG): children must be started from a thread that lives
as long as the process (tandem up's main thread, the engine group's).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
# Resolved once, here: between fork and exec a child may not load libraries.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _ask_kernel() -> bool:
    return _prctl is not None and _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def die_with(parent: int) -> None:
    """In a child (a Python process): be killed when `parent` dies. Linux asks the
    kernel; elsewhere a thread watches for the child being handed to another parent."""
    if _ask_kernel():
        if os.getppid() != parent:  # it died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)
        return

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def preexec() -> Callable[[], None] | None:
    """subprocess.Popen's preexec_fn for a child of any program (redis-server) that dies
    with this process: Linux only, else None (nothing to run)."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def in_child() -> None:  # between fork and exec: a system call, nothing more
        if _ask_kernel() and os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child
