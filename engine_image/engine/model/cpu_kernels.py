"""Tandem's C++ CPU kernels (csrc/*.cpp), compiled once per machine on first use.

    ops = cpu_kernels.load()  # torch.ops.tandem_cpu, or None: use the pure-torch paths

Built just in time with torch.utils.cpp_extension.load (ninja and the system C++
compiler, ~20 s) into a build directory under the user's cache,
$XDG_CACHE_HOME/tandem/cpu_kernels/<key> (~/.cache when unset), where key names the
torch version, the Python ABI, the instruction-set flags and a hash of the sources:
later processes on the same machine (and a CI run's later jobs) reuse the library,
and any change to those inputs builds afresh. The instruction-set flags come from
this machine's CPU (/proc/cpuinfo), never -march=native, so a cache directory
shared by machines with different CPUs holds one build per flag set and none runs
instructions its CPU lacks. The optional extensions (AVX512-BF16, AMX: the greedy
head's screens) are asked for only where the compiler takes their flags.

When the build or the load fails (no compiler, no ninja, a non-x86 toolchain
missing a flag...), load() warns once through `warnings` and returns None, and
the callers keep the pure-torch paths. Set TANDEM_CPU_KERNELS=0 to use those
paths without trying (the tests do so to cover them).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

ENV_DISABLE = "TANDEM_CPU_KERNELS"
# The widest instruction sets the kernels may be built with, narrowest first. By default
# whatever this CPU has; TANDEM_CPU_ISA caps it (to run, and test, the AVX2 paths that
# older and AMD CPUs take on a newer one).
ENV_ISA = "TANDEM_CPU_ISA"
ISA_LEVELS = ("avx2", "avx512", "amx")
BF16_FLAG = "-mavx512bf16"
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
# Tensor dtypes the kernels take.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CSRC = Path(__file__).parent / "csrc"
# Compiled into one library; the headers beside them count for the build key too.
SOURCES = (
    CSRC / "cpu_kernels.cpp",  # declares every op; the elementwise kernels, argmax
    CSRC / "decode_attention.cpp",
    CSRC / "prefill_attention.cpp",
    CSRC / "panel_linear.cpp",  # the float32 projections (linear.py)
    CSRC / "greedy_head.cpp",  # greedy rows' LM head (greedy_head.py)
    CSRC / "split_linear.cpp",  # float32 products on AMX tiles (split_planes.py)
    CSRC / "split_attention.cpp",  # float32 prefill attention on AMX tiles
)


def for_tensors(*tensors: torch.Tensor) -> object | None:
    """torch.ops.tandem_cpu when the kernels can take these tensors (on the CPU, in a dtype
    they take, none that autograd tracks: the kernels have no backward), else None."""
    if any(t.device.type != "cpu" or t.dtype not in DTYPES for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return load()


def enabled_by_env() -> bool:
    return os.environ.get(ENV_DISABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def isa_cap() -> str:
    """The widest instruction set TANDEM_CPU_ISA lets the kernels use (default: amx, all)."""
    value = os.environ.get(ENV_ISA, ISA_LEVELS[-1]).strip().lower()
    if value not in ISA_LEVELS:
        raise ValueError(
            f"{ENV_ISA}={value!r}: use one of {', '.join(ISA_LEVELS)} (the widest instruction "
            "set the C++ kernels may use), or leave it unset for all this CPU has"
        )
    return value


def cpu_flags() -> set[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def isa_flags() -> list[str]:
    """Compiler flags for the vector extensions this CPU has (x86-64 Linux; else none), up
    to isa_cap()."""
    cap = ISA_LEVELS.index(isa_cap())

    def allowed(level: str) -> bool:
        return cap >= ISA_LEVELS.index(level)

    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return []
    # AVX-512VL: 32 vector registers, which the prefill attention's register tiles need
    # (its vectors stay 256-bit wide). Measured on AMD Zen 4: that kernel 1.3x faster,
    # the others no different.
    wide = (
        ["-mavx512f", "-mavx512vl"]
        if {"avx512f", "avx512vl"} <= flags and allowed("avx512")
        else []
    )
    # AVX512-BF16's dot products: greedy_head's screen (has_bf16_dot); on AMX's tiles
    # where the CPU has them (csrc/amx_tiles.h; the OS must grant them too: amx_ready).
    # Only where the compiler knows them (compiler_accepts): a CPU can be newer than it.
    if wide and "avx512_bf16" in flags and compiler_accepts((BF16_FLAG,)):
        wide.append(BF16_FLAG)
        if {"amx_tile", "amx_bf16"} <= flags and allowed("amx") and compiler_accepts(AMX_FLAGS):
            wide += AMX_FLAGS
    return ["-mavx2", "-mfma", "-mf16c", *wide]


@functools.cache  # one probe per flag set and process
def compiler_accepts(flags: tuple[str, ...]) -> bool:
    """Whether the C++ compiler torch builds with (CXX, else c++) takes these flags. A CPU
    may have an extension its compiler predates (AVX512-BF16 needs GCC 10, AMX GCC 11),
    and one refused flag would fail the whole build: the kernels that need it are left
    out instead (greedy_head's screens)."""
    compiler = os.environ.get("CXX", "c++")
    try:
        probe = subprocess.run(
            [compiler, *flags, "-x", "c++", "-fsyntax-only", "-"],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def has_bf16_dot() -> bool:
    """Whether the kernels are built with AVX512-BF16 (greedy_head needs it)."""
    return BF16_FLAG in isa_flags()


def build_directory(sources: tuple[Path, ...], cflags: list[str]) -> Path:
    files = sorted({*sources, *(h for s in sources for h in s.parent.glob("*.h"))})
    key_parts = [
        torch.__version__,
        f"{sys.implementation.cache_tag}{getattr(sys, 'abiflags', '')}",
        " ".join(cflags),
        *(hashlib.sha256(f.read_bytes()).hexdigest() for f in files),
    ]
    key = hashlib.sha256("\n".join(key_parts).encode()).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "tandem" / "cpu_kernels" / f"torch{torch.__version__}-{key}"


def load() -> object | None:
    """torch.ops.tandem_cpu with the kernels registered, or None if disabled or unavailable."""
    if not enabled_by_env():
        return None
    return _built()


@functools.cache  # one build (or one failed try, warned once) per process
def _built() -> object | None:
    return build(SOURCES)


def build(sources: tuple[Path, ...]) -> object | None:
    """Compile (or reuse the cached build of) sources and load them; None, warned, on failure."""
    from torch.utils import cpp_extension

    # -fno-trapping-math (as torch itself builds): lets gcc if-convert, so vectorise, the
    # float clamps and selects of the softmax loops. Nothing reads floating-point traps.
    cflags = ["-O3", "-fopenmp", "-fno-trapping-math", *isa_flags()]
    try:
        directory = build_directory(sources, cflags)
        directory.mkdir(parents=True, exist_ok=True)
        with _exclusive(directory / "tandem.lock"), warnings.catch_warnings():
            # torch's own lock file is stale if present: no live process holds ours (a
            # build killed midway leaves it behind, and torch would wait on it forever).
            (directory / "lock").unlink(missing_ok=True)
            # e.g. a compiler-version advisory: only a failure is worth the user's attention.
            warnings.simplefilter("ignore")
            cpp_extension.load(
                name="tandem_cpu_kernels",
                sources=[str(s) for s in sources],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        return torch.ops.tandem_cpu
    except Exception as exc:  # any failure means: use the torch paths
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        reason = " / ".join(lines[-3:]) if lines else type(exc).__name__
        warnings.warn(
            f"Tandem's C++ CPU kernels are unavailable ({type(exc).__name__}: {reason[:500]}); "
            f"using the pure-torch paths (slower). Set {ENV_DISABLE}=0 to skip the build.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


@contextlib.contextmanager
def _exclusive(path: Path, timeout_s: float = 600.0) -> Iterator[None]:
    """An advisory lock across processes, which the OS drops if its holder dies."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock file alone
        yield
        return
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} held for over {timeout_s:.0f} s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
