"""The CPU cores this process may really use: those it may run on, within a container's
CPU quota. torch counts the machine's cores, and its OpenMP workers spin at every
barrier, so threads beyond these cost several times their share (docs/engine-service.md,
"CPU threads")."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

# cgroup v2's quota file: "<quota> <period>" in microseconds, or "max <period>".
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = CPU_MAX) -> int:
    """The cores this process may run on (its affinity), fewer where a CPU quota caps it
    (a container's CPU limit: 2.5 CPUs are 3 cores' worth of threads)."""
    cores = len(os.sched_getaffinity(0))
    # No cgroup v2 here, or a file of another form: the affinity alone.
    with contextlib.suppress(OSError, ValueError):
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    return cores
