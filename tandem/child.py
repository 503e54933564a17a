"""One process `tandem up` supervises: start, probes, restart backoff, ordered stop.

The probes and their timing are the ones the operator gives engine pods in a
cluster (docs/operator.md): readiness from /readyz, liveness from /healthz
every 10 s with 6 failures allowed, so a process that hangs (a stopped or
deadlocked engine) is restarted here as the kubelet would restart it there.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tandem import parent_death
from tandem.cpu_cores import usable_cores

# A child that stayed up this long starts its backoff afresh when it dies.
STABLE_AFTER_S = 60.0
# The longest wait before a restart: 1, 2, 4 ... seconds, then this.
MAX_BACKOFF_S = 30.0
# How a log line says why its process exited: its own `tandem: error:` line, uvicorn's
# ERROR line, or a traceback's last line (`redis.exceptions.ConnectionError: ...`).
_REASON = re.compile(r"(?:tandem: error:|ERROR:)\s*(.+)|([\w.]*(?:Error|Exception)\b.*)")
# As the pods' probes: until a child first answers its liveness URL (its startupProbe)
# it is asked this often, then every liveness period. (Asked every 10 s from the start,
# an engine that hung within that of its start was never seen up, so never probed
# for liveness, and hung for good with its requests.)
STARTUP_PROBE_S = 1.0
# The most of a log's end read for why its child exited.
_TAIL = 64 * 1024
# A child that has not answered this long after its start is killed and started again,
# as a pod's startupProbe does (180 failures 10 s apart): a load stuck for good, or an
# engine that hung before its first answer, would otherwise never be probed. Liveness,
# not readiness: an engine that cannot reach Redis is up, only not ready, and a
# restart (a model load) would not bring Redis back.
STARTUP_DEADLINE_S = 1800.0


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    log_path: Path
    ready_url: str
    restartable: bool
    process: subprocess.Popen | None = None
    # Restarts in a row: each waits twice as long, up to 30 s; reset once it stays up.
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    # Stopped after the children of the stage before have drained: decode engines
    # go last, for the prompt engines wait until decoders fetched their KV.
    stop_stage: int = 0
    # Liveness: GET this every liveness_period_s once it first answered; after
    # liveness_failures failures in a row it is hung. Empty: not probed.
    live_url: str = ""
    liveness_period_s: float = 10.0
    liveness_failures: int = 6
    startup_deadline_s: float = STARTUP_DEADLINE_S
    _was_live: bool = field(default=False, init=False)
    _failures: int = field(default=0, init=False)
    _next_probe: float = field(default=0.0, init=False)
    _said_ready: bool = field(default=False, init=False)  # "ready" said since its start
    # Where this start's lines begin in its log: a log of earlier runs (a reused
    # --log-dir) or starts holds their errors, not this one's.
    _log_start: int = field(default=0, init=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # removed meanwhile: again
        log = open(self.log_path, "ab")  # noqa: SIM115 (lives as long as the process)
        self._log_start = os.fstat(log.fileno()).st_size
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.process = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=parent_death.preexec(),  # killed with tandem up, not left serving
        )
        self.started_at = time.monotonic()
        self._was_live, self._failures, self._next_probe = False, 0, 0.0
        self._said_ready = False
        log.close()

    @property
    def started_up(self) -> bool:
        """Whether it answered its liveness URL since it started: from then on, it is
        probed every liveness period."""
        return self._was_live

    @property
    def answering(self) -> bool:
        """Up and answering its liveness probe at the last ask (busy, maybe: not hung)."""
        return self._was_live and self._failures == 0 and self.alive

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ready(self) -> bool:
        return _answers(self.ready_url)

    def newly_ready(self) -> bool:
        """Whether it is ready and was not yet said to be since it (re)started."""
        if self._said_ready or not self.ready_url or not self.alive or not self.ready():
            return False
        # Its probe server answers: it is up, and from now on its liveness counts (one
        # that hung before its first /healthz ask waited out the startup deadline).
        self._said_ready = self._was_live = True
        return True

    def hung(self, now: float) -> bool:
        """Whether the child stopped answering its liveness probe, or never answered
        within its startup deadline (then restart it).

        Loading a model can take minutes, and an engine's HTTP server starts after
        that: until its first answer, only the startup deadline counts.
        """
        if not self.live_url or not self.alive or now < self._next_probe:
            return False
        self._next_probe = now + self.liveness_period_s
        if not self._was_live:
            self._was_live = _answers(self.live_url)
            if not self._was_live:  # asked often, as a startupProbe is
                self._next_probe = now + min(STARTUP_PROBE_S, self.liveness_period_s)
                return now - self.started_at > self.startup_deadline_s
            return False
        self._failures = 0 if _answers(self.live_url) else self._failures + 1
        return self._failures >= self.liveness_failures

    def supervise(self, now: float) -> list[str]:
        """Restart it if it hung or died, after its backoff; what to tell the user
        (that too, and when it is ready after a start).

        As the kubelet restarts a pod's container: the same child (its name, its
        engine id) again, 1, 2, 4 ... 30 s after each failure in a row, so a
        process that cannot start is not started again and again at once.
        """
        said = []
        if self.restartable and self.hung(now):
            if self.started_up:
                said.append(f"{self.name} stopped answering {self.live_url}; killing it")
            else:
                wait = self.startup_deadline_s
                waited = f"{wait / 60:g} min" if wait >= 60 else f"{wait:g} s"
                said.append(
                    f"{self.name} did not answer {self.live_url} {waited} after its start; "
                    "killing it"
                )
            self.kill()
        if self.alive or not self.restartable:
            if self.newly_ready():  # restarted, or started by a scale-up: up again
                said.append(f"{self.name:<10} ready")
            return said
        if self.next_start == 0.0:
            delay = self.backoff(now)
            said.append(f"{self.name} exited ({self.exit_reason()}); restarting in {delay:.0f}s")
            self.next_start = now + delay
        elif now >= self.next_start:
            self.restarts += 1
            self.next_start = 0.0
            try:
                self.start()
            except OSError as exc:  # its log unwritable, no fork: said, and tried again
                said.append(f"{self.name} could not restart: {exc}; trying again")
        return said

    def backoff(self, now: float) -> float:
        """Seconds to wait before starting it again, now that it died."""
        if now - self.started_at >= STABLE_AFTER_S:
            self.restarts = 0  # a crash after a long run is not a crash loop
        return min(MAX_BACKOFF_S, 2.0**self.restarts)

    def signal(self, signum: int) -> None:
        if self.alive:
            self.process.send_signal(signum)

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
            self.process.wait()

    def wait_or_kill(self, deadline: Callable[[], float]) -> None:
        """Wait for the process to exit until deadline() (monotonic, asked again as it
        waits: a second Ctrl-C brings it closer), then kill it."""
        if self.process is None:
            return
        while True:
            left = deadline() - time.monotonic()
            try:
                self.process.wait(timeout=min(max(0.1, left), 0.5))
                return
            except subprocess.TimeoutExpired:
                if left <= 0.5:
                    self.kill()
                    return

    def exit_reason(self) -> str:
        """Its exit status and why, as `1: <its log's error>` or `-9: killed by SIGKILL`
        (a signal: its log says nothing of it)."""
        code = self.process.returncode if self.process else None
        if code is not None and code < 0:
            return f"{code}: killed by {_signal_name(-code)}"
        return f"{code}: {self.last_error()}" if code else f"{code}"

    def last_error(self) -> str:
        """Why it exited, in one line of what it logged since its start: the last that
        reads as an error, else the last line."""
        try:
            with open(self.log_path, "rb") as log:
                size = os.fstat(log.fileno()).st_size
                # The end of it only: a long run's log may be large. Cut (rotated,
                # truncated) below where this start began: all of it.
                log.seek(max(self._log_start if self._log_start <= size else 0, size - _TAIL))
                lines = log.read().decode(errors="replace").split("\n")
        except OSError:
            lines = []
        lines = [line.strip() for line in lines if line.strip()]
        for line in reversed(lines):
            if found := _REASON.match(line):
                return found.group(1) or found.group(2)
        return lines[-1] if lines else "its log is empty"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return f"signal {number}"


def engine_child(
    name: str, flags: list[str], port: int, log_path: Path, redis_url: str, *, decodes: bool
) -> Child:
    """A local `tandem engine` with these flags (its --port `port` among them), as
    `tandem up` runs one: restarted when it dies or hangs, its Redis URL in its
    environment (on its command line, ps would show a password to every user of the
    machine), stopped after the others when it `decodes` (prompt engines wait until
    decoders fetched their KV)."""
    return Child(
        name,
        [sys.executable, "-m", "tandem.cli", "engine", *flags],
        log_path,
        f"http://127.0.0.1:{port}/readyz",
        restartable=True,
        env={"TANDEM_REDIS_URL": redis_url},
        stop_stage=1 if decodes else 0,
        live_url=f"http://127.0.0.1:{port}/healthz",
    )


def drain_in_order(children: Iterable[Child], deadline: Callable[[], float]) -> None:
    """SIGTERM the children stage by stage (Child.stop_stage), each stage once the one
    before has exited; whatever is still running at deadline() is killed."""
    stages: dict[int, list[Child]] = {}
    for child in children:
        stages.setdefault(child.stop_stage, []).append(child)
    for stage in sorted(stages):
        for child in stages[stage]:
            child.signal(signal.SIGTERM)
        for child in stages[stage]:
            child.wait_or_kill(deadline)


def engine_threads(num_engines: int) -> int | None:
    """CPU threads for each of num_engines engines sharing this machine's cores.

    Sharing beats oversubscribing: torch's OpenMP workers spin at every barrier,
    so an engine whose threads outnumber the cores it really has runs several
    times slower (measured here: `tandem demo` answered in 11 s with 2 threads
    beside one busy core, 0.6 s with 1). One core stays for the gateway and
    Redis. None: the user set OMP_NUM_THREADS, which the engines inherit.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (usable_cores() - 1) // max(1, num_engines))


# This machine's own servers are asked directly: a proxy from the environment
# (HTTP_PROXY, which NO_PROXY rarely exempts 127.0.0.1 from) answered for them, or not.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def local_get(request: str | urllib.request.Request, timeout: float) -> bytes | None:
    """The body of a 200 answer to a GET on this machine, else None."""
    try:
        with _DIRECT.open(request, timeout=timeout) as resp:
            return resp.read() if resp.status == 200 else None
    except (OSError, http.client.HTTPException):  # a port a child has not opened yet, too
        return None


def _answers(url: str) -> bool:
    return local_get(url, timeout=1) is not None
