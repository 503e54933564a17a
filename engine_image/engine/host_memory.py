"""The engine's host memory: freed memory kept for the next step, big pools on huge pages.

glibc's malloc serves large blocks with fresh mmap()s and returns the free memory
at the heap's top to the OS (trimming), so a CPU engine page-faults its activations
in again at every step: ~40,000 faults (~160 MiB that the kernel zeroes) for each
1,024-token SmolLM2 prefill, measured at ~5 % of its time. Raising both
thresholds keeps that memory mapped for reuse. Resident memory then stays at the
peak a step needs, which the next such step needs again.

Process-wide and one-way (as torch.set_num_threads is), so the engine applies it
once, after the weights are loaded (their load-time copies are freed to the OS
first), and only when the model runs on the CPU.

Huge pages: where Linux gives transparent huge pages only to memory that asks
(`madvise` mode), a pool read in scattered pieces, the KV cache, sits on 4 KiB
pages, and a batch-64 SmolLM2 step's attention walks up to ~2,300 of them a layer.
On 2 MiB pages decode attention read scattered blocks ~4 % faster; in an engine's
batch-64 step, whose blocks lie mostly in order, ~1 % (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import os

MADV_HUGEPAGE = 14  # madvise() advice, from Linux's <sys/mman.h>
# mallopt() parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap, and this much free memory may stay at
# its top. Blocks larger still (a big model's KV cache) keep their own mappings.
RETAIN_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """True if malloc now keeps freed memory for reuse; False where the C library is
    not glibc (no mallopt, or one that refuses), which changes nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, RETAIN_BYTES) == 1 for param in (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD))


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the whole pages of [address, address + nbytes) with huge pages
    as they are first touched (so: before anything writes them). False where it cannot
    (not Linux, a kernel without transparent huge pages), which changes nothing."""
    try:
        madvise = ctypes.CDLL(None).madvise
        page = os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0


def memory_limit() -> int | None:
    """The bytes this process could ever hold: the machine's memory, or its cgroup's
    limit where lower (a container's); None where neither can be read."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        limit = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            limit = int(text) if limit is None else min(limit, int(text))
        break
    return limit
