"""One engine asked to stop before it serves: it says so and exits 0. A real
`tandem engine`, signalled once it takes SIGTERM, while it still loads."""

import signal
from pathlib import Path

from support.engines import EngineProcess
from support.polling import eventually

from tandem.engine.service.registry import Registry


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
