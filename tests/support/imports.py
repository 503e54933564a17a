"""What importing a module loads, seen from a fresh interpreter (this one has loaded
everything already): the tests that hold a layer to the packages it may import."""

from __future__ import annotations

import subprocess
import sys


def modules_loaded(statement: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running `statement`, sorted."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise AssertionError(f"{statement!r} failed:\n{out.stderr}")
    return out.stdout.split()


def packages_loaded(statement: str, among: set[str]) -> list[str]:
    """Which of the top-level packages `among` running `statement` loads, sorted."""
    return sorted({m.split(".")[0] for m in modules_loaded(statement)} & among)
