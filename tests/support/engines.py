"""Real engine processes for service tests, and a client speaking the Redis protocol."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

from support.response_reader import ResponseReader
from tandem.backlog import ENQUEUE_SCRIPT, enqueue, enqueue_call
from tandem.keys import Keys
from tandem.protocol import (
    PRIORITY_NORMAL,
    WORK_GROUP,
    EventKind,
    ResponseEvent,
    WorkItem,
    as_text,
)
from tandem.redis_server import free_port

MODEL = "random:tiny"


@dataclass
class EngineProcess:
    role: str
    redis_url: str
    keys: Keys
    extra: list[str] = field(default_factory=list)
    model: str = MODEL
    served_name: str = "tiny"
    log_dir: Path | None = None
    # Rank r of a data-parallel group listens on port + r (tests run up to 4 ranks).
    port: int = field(default_factory=lambda: free_port(4))
    kv_port: int = field(default_factory=lambda: free_port(4))
    engine_id: str = field(default_factory=lambda: f"e-{uuid.uuid4().hex[:6]}")
    process: subprocess.Popen | None = None

    def start(self) -> EngineProcess:
        self.start_command([sys.executable, "-m", "tandem.cli", "engine", *self.flags()])
        return self

    def flags(self) -> list[str]:
        """`tandem engine`'s flags for this engine."""
        return [
            "--role", self.role,
            "--model", self.model,
            "--served-model-name", self.served_name,
            "--redis-url", self.redis_url,
            "--key-prefix", self.keys.prefix,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--kv-port", str(self.kv_port),
            "--engine-id", self.engine_id,
            "--max-model-len", "256",
            "--num-kv-blocks", "128",
            # Unseeded draws the same from run to run (engines take an OS seed by
            # default): a test's sampled answers do not change between runs.
            "--seed", "0",
            *self.extra,
        ]  # fmt: skip

    def start_command(self, cmd: list[str]) -> None:
        """Runs cmd as this engine's process, its output to the engine's log."""
        log = open(self._log_path(), "wb")  # noqa: SIM115 (lives as long as the process)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def _log_path(self) -> Path:
        folder = self.log_dir or Path("/tmp")
        return folder / f"{self.engine_id}.log"

    def log(self) -> str:
        return self._log_path().read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> EngineProcess:
        # A wait, not a measurement: generous for a loaded machine (an engine that
        # exits fails at once).
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine exited {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url("/readyz"), timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine not ready after {timeout}s:\n{self.log()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Samples of /metrics as (name, labels, value)."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=5) as resp:
            text = resp.read().decode()
        samples = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            name, _, labels = head.partition("{")
            pairs = re.findall(r'(\w+)="([^"]*)"', labels)
            samples.append((name, dict(pairs), float(value)))
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of one metric whose labels include the given ones."""
        return sum(
            value
            for sample, have, value in self.metrics()
            if sample == name and labels.items() <= have.items()
        )

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self, timeout: float = 60.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


@dataclass
class Answer:
    token_ids: list[int]
    text: str
    final: ResponseEvent
    engines: set[str]

    @property
    def ok(self) -> bool:
        return self.final.event == EventKind.FINISH


class Client:
    """Submits work items and reads their response streams, as the gateway does."""

    def __init__(self, redis_url: str, keys: Keys, model: str = "tiny") -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.keys = keys
        self.model = model

    def submit(self, **fields) -> str:
        rid = fields.pop("request_id", None) or f"req-{uuid.uuid4().hex[:8]}"
        fields.setdefault("sampling", {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
        enqueue(self.redis, self.keys, WorkItem(rid, self.model, **fields))
        return rid

    def submit_burst(self, count: int, **fields) -> list[str]:
        """Queue `count` requests at once, in one script call, as the gateway queues the n
        choices of a request: engines find them all there together."""
        fields.setdefault("sampling", {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
        ids = [f"req-{uuid.uuid4().hex[:8]}" for _ in range(count)]
        items = [WorkItem(rid, self.model, **fields) for rid in ids]
        script_keys, args = enqueue_call(self.keys, items)
        self.redis.register_script(ENQUEUE_SCRIPT)(keys=script_keys, args=args)
        return ids

    def held(self) -> dict[str, int]:
        """The entries each engine holds (taken, not yet acknowledged) of the model's
        normal-priority work stream, by engine id."""
        stream = self.keys.work_stream(self.model, PRIORITY_NORMAL)
        consumers = self.redis.xinfo_consumers(stream, WORK_GROUP)
        return {as_text(c["name"]): c["pending"] for c in consumers if c["pending"]}

    def events(self, request_id: str, timeout: float = 60.0):
        return ResponseReader(self.redis, self.keys).events(request_id, timeout=timeout)

    def answer(self, request_id: str, timeout: float = 60.0) -> Answer:
        tokens, text, engines = [], [], set()
        for event in self.events(request_id, timeout):
            engines.add(event.engine_id)
            if event.event == EventKind.TOKENS:
                tokens.extend(event.token_ids)
                text.append(event.text)
            if event.is_final:
                return Answer(tokens, "".join(text), event, engines)
        raise TimeoutError(f"no final event for {request_id} within {timeout}s")

    def close(self) -> None:
        self.redis.close()
