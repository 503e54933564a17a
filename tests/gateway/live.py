"""Live gateways (uvicorn in a thread, real HTTP) and engines for the gateway tests."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import httpx
import openai
import redis
import uvicorn
from support.engines import EngineProcess

from tandem.engine.service.registry import Registry
from tandem.gateway.app import create_app
from tandem.gateway.auth import KeyStore
from tandem.gateway.server import server_config
from tandem.gateway.settings import GatewaySettings
from tandem.keys import Keys
from tandem.protocol import PRIORITY_NORMAL, WorkItem
from tandem.redis_server import free_port

API_KEY = "sk-tandem-test"
# The model of the stand_in_gateway fixture's engine (conftest.py).
STAND_IN = "stand-in"


class LiveGateway:
    """One gateway replica served over real HTTP on a free port, in a thread."""

    def __init__(self, settings: GatewaySettings, key_store: KeyStore | None = None) -> None:
        self.settings = settings
        self.app = create_app(settings, key_store=key_store)
        config = server_config(self.app, settings, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def start(self, timeout: float = 10.0) -> LiveGateway:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)

    def openai(self, api_key: str = API_KEY, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, **kwargs)

    def http(self, api_key: str | None = API_KEY, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        kwargs.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, headers=headers, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of one gateway metric whose labels include these."""
        registry = self.app.state.gateway.metrics.registry
        return sum(
            sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


def settings_for(url: str, keys: Keys, **overrides) -> GatewaySettings:
    fields = dict(redis_url=url, key_prefix=keys.prefix, port=free_port(), host="127.0.0.1")
    return GatewaySettings(**(fields | overrides))


def start_engine(
    role: str, redis_url: str, keys: Keys, log_dir: Path, *extra: str
) -> EngineProcess:
    # The optional C++ kernels compile on first use: not in tests that only
    # need an engine to answer.
    with mock.patch.dict(os.environ, {"TANDEM_CPU_KERNELS": "0"}):
        return EngineProcess(role, redis_url, keys, list(extra), log_dir=log_dir).start()


@contextlib.contextmanager
def serving_engine(
    role: str, redis_url: str, keys: Keys, log_dir: Path, *extra: str
) -> Iterator[EngineProcess]:
    """A started, served engine, stopped on leaving (also if it never became served)."""
    proc = start_engine(role, redis_url, keys, log_dir, *extra)
    try:
        yield wait_served(proc)
    finally:
        proc.stop()


def wait_served(proc: EngineProcess, timeout: float = 60.0) -> EngineProcess:
    """Ready, and so in the registry: the gateway only routes to registered
    engines, and an engine reports ready only once its first heartbeat landed."""
    proc.wait_ready(timeout)
    client = redis.Redis.from_url(proc.redis_url)
    try:
        live = {e.engine_id for e in Registry(client, proc.keys).live()}
    finally:
        client.close()
    if proc.engine_id not in live:
        raise AssertionError(f"engine {proc.engine_id} is ready but not registered:\n{proc.log()}")
    return proc


def take_queued(conn: redis.Redis, keys: Keys, model: str = STAND_IN) -> str:
    """The request id of the next work item queued for `model`, taken off its queue as
    a stand-in engine would take it."""
    queue = keys.work_stream(model, PRIORITY_NORMAL)
    deadline = time.monotonic() + 10
    while not (entries := conn.xrange(queue)):
        if time.monotonic() > deadline:
            raise AssertionError("the gateway queued nothing")
        time.sleep(0.01)
    conn.xdel(queue, entries[0][0])
    return WorkItem.from_fields(entries[0][1]).request_id
