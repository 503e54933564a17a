"""One engine asked to stop before it serves: it says so and exits 0. A real
`tandem engine`, signalled once it takes SIGTERM, while it still loads."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

from support.engines import EngineProcess
from support.polling import eventually

from tandem.engine.service.registry import Registry
from tandem.process_tree import descendants, running


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_an_engine_stopped_while_starting_says_so_and_exits_0(redis_url, keys, client, tmp_path):
    # A scale-down mid-load killed it by the signal (exit 143), its log saying nothing.
    engine = EngineProcess("normal", redis_url, keys, [], log_dir=tmp_path).start()
    try:
        assert eventually(lambda: _catches_sigterm(engine.process.pid), timeout=30)
        engine.process.send_signal(signal.SIGTERM)  # long before its model is loaded
        code = engine.process.wait(timeout=60)
    finally:
        engine.stop()
    assert code == 0, engine.log()
    assert "stopped while starting (SIGTERM): nothing was taken" in engine.log()
    assert "Traceback" not in engine.log()
    assert not Registry(client.redis, keys).live()


# Where the CI's signal landed: torch's C++ init imports numpy and takes any failure
# as "no numpy", so a SystemExit raised there was swallowed and the load went on.
_SIGNALLED_AS_TORCH_IMPORTS_NUMPY = textwrap.dedent("""
    import os, signal, sys
    from tandem.engine.service.logs import log_to_stderr
    from tandem.engine.service.main import _stopped_while_starting
    if "numpy" in sys.modules:
        raise SystemExit("numpy was imported before torch: this test no longer tests it")
    log_to_stderr()
    signal.signal(signal.SIGTERM, _stopped_while_starting)

    class SignalOnNumpy:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy":
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGTERM)
            return None

    sys.meta_path.insert(0, SignalOnNumpy())
    import torch
    print("went on loading")
""")


def test_a_stop_while_torch_imports_is_not_lost():
    done = subprocess.run(
        [sys.executable, "-P", "-c", _SIGNALLED_AS_TORCH_IMPORTS_NUMPY],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "stopped while starting (SIGTERM)" in done.stderr
    assert "went on loading" not in done.stdout


def _building(pid: int) -> dict[int, str]:
    """The processes under `pid`, each with its command name."""
    names = {}
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            names[child] = Path(f"/proc/{child}/comm").read_text().strip()
    return names


def test_an_engine_stopped_while_building_its_kernels_leaves_no_compiler_behind(
    redis_url, keys, tmp_path
):
    # Its ninja and compilers outlived it, and raced the next engine's build into the
    # same folder, its lock gone with it.
    with mock.patch.dict(os.environ, {"XDG_CACHE_HOME": str(tmp_path / "cache")}):
        engine = EngineProcess("normal", redis_url, keys, [], log_dir=tmp_path).start()
    try:
        pid = engine.process.pid
        assert eventually(lambda: "ninja" in _building(pid).values(), timeout=120)
        building = _building(pid)
        engine.process.send_signal(signal.SIGTERM)
        assert engine.process.wait(timeout=30) == 0, engine.log()
    finally:
        engine.stop()
    assert eventually(lambda: not any(map(running, building)), timeout=5), building
