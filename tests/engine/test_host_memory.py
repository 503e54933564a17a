"""On the CPU an engine keeps freed heap memory (engine/host_memory.py): each prefill
reuses the last one's pages instead of faulting fresh, zeroed ones in; and its KV
cache asks for huge pages before it is first touched.

mallopt is process-wide and one-way, so the allocator's behaviour is measured in
interpreters of its own.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tandem.engine.llm as llm_module
from tandem.engine import LLM
from tandem.engine.model import attention
from tandem.engine.model.attention import allocate_kv_cache
from tandem.engine.model.random_model import random_config

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


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_MODE = THP.read_text().split("[")[1].split("]")[0] if THP.exists() else "never"
needs_thp = pytest.mark.skipif(
    THP_MODE == "never", reason="this kernel gives no transparent huge pages (off or absent)"
)
# A 64 MiB block's huge pages (kB), without and with advise_huge_pages before its first
# touch, read from the smaps entry of the mapping that holds it (a fresh interpreter:
# glibc's default thresholds give a block that size a mapping of its own).
HUGE_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from tandem.engine.host_memory import advise_huge_pages

    block = torch.empty(64 << 20, dtype=torch.uint8)
    advised = sys.argv[1] == "advise" and advise_huge_pages(block.data_ptr(), 64 << 20)
    block.fill_(1)
    # Past the block's first page: advice splits off the part of a page it cannot cover.
    address, huge, inside = block.data_ptr() + (1 << 21), None, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
    print(json.dumps([advised, huge]))
    """
)


def huge_kilobytes(mode: str) -> tuple[bool, int]:
    done = subprocess.run(
        [sys.executable, "-c", HUGE_SCRIPT, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    advised, huge = json.loads(done.stdout.splitlines()[-1])
    return advised, huge


@needs_thp
def test_advised_memory_lies_on_huge_pages() -> None:
    advised, huge = huge_kilobytes("advise")
    assert advised and huge >= 32 * 1024, huge  # most of the 64 MiB
    if THP_MODE == "madvise":  # where only advised memory gets them, the default has none
        assert huge_kilobytes("default") == (False, 0)


def test_cpu_kv_caches_are_advised_before_their_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    # The spy writes ones where it is asked to advise: the caches come out zero only if
    # the zeros come after the advice (huge pages are given at the first touch).
    blocks: list[torch.Tensor] = []
    advised: list[tuple[int, int]] = []
    real_empty = torch.empty

    def empty(*args, **kwargs) -> torch.Tensor:
        blocks.append(real_empty(*args, **kwargs))
        return blocks[-1]

    def spy(address: int, nbytes: int) -> bool:
        next(b for b in blocks if b.data_ptr() == address).fill_(1)
        advised.append((address, nbytes))
        return True

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(attention, "advise_huge_pages", spy)
    config = random_config("tiny")
    caches = allocate_kv_cache(config, 8, 4, dtype=torch.float32, device="cpu")
    assert len(caches) == config.num_hidden_layers
    assert advised == [(c.data_ptr(), c.numel() * c.element_size()) for c in caches]
    assert not any(c.any() for c in caches)
