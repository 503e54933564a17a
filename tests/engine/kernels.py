"""What the engine's tests share about the C++ CPU kernels (cpu_kernels.py)."""

from __future__ import annotations

import pytest

from tandem.engine.model import cpu_kernels

# Tests of a kernel itself, skipped (with cpu_kernels' warning saying why) where the
# kernels cannot be built: no compiler, or a toolchain without the flags.
needs_kernels = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="the C++ CPU kernels could not be built here"
)
