"""On the CPU an engine keeps freed heap memory (engine/host_memory.py): each prefill
reuses the last one's pages instead of faulting fresh, zeroed ones in.

mallopt is process-wide and one-way, so the allocator's behaviour is measured in
interpreters of its own.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap

import pytest

import tandem.engine.llm as llm_module
from tandem.engine import LLM

glibc_only = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the thresholds it sets are glibc malloc's"
)

# Page faults of five 64 MiB blocks from malloc, each written and freed before the
# next. 64 MiB is past the largest mmap threshold glibc's defaults ever adapt to (32
# MiB), so by default every block is a fresh mapping, whatever the process allocated
# before: that is what a long prefill's activations did (~40,000 faults a 1,024-token
# SmolLM2 prefill, docs/benchmarks.md). The engine's own blocks come and go with
# glibc's moving thresholds and torch's alignment, too erratically for a test.
SCRIPT = textwrap.dedent(
    """
    import ctypes, json, resource, sys
    from tandem.engine.host_memory import keep_freed_memory

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    faults = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(64 << 20)
        libc.memset(block, 1, 64 << 20)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps(faults))
    """
)
PAGES = 64 * 2**20 // 4096


def block_faults(mode: str) -> list[int]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@glibc_only
def test_kept_memory_is_reused_instead_of_faulted_in_again() -> None:
    default, keep = block_faults("default"), block_faults("keep")
    # Every block faults all its pages in by default (so the next line can fail)...
    assert all(faults > PAGES // 2 for faults in default), default
    # ...and only the first one with the change: the others reuse its pages.
    assert keep[0] > PAGES // 2 and all(faults < PAGES // 100 for faults in keep[1:]), keep


def test_a_cpu_engine_keeps_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    monkeypatch.setattr(llm_module, "keep_freed_memory", lambda: calls.append(True) or True)
    LLM("random:tiny", max_model_len=64, num_kv_blocks=8)
    assert calls == [True]
