"""`tandem up` as a supervisor: stopping in order, Redis restarted, crash backoff."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.stacks import running_stack

from tandem.redis_server import free_port
from tandem.up import STABLE_AFTER_S, Child, Stack, UpConfig

pytestmark = pytest.mark.timeout(240)

API_KEY = "sk-up-test"


def config(tmp_path, monkeypatch, **fields) -> UpConfig:
    # The optional C++ kernels compile on first use: not needed to answer.
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    return UpConfig(
        model="random:tiny",
        served_model_name="tiny",
        port=free_port(),
        api_key=API_KEY,
        log_dir=tmp_path / "up",
        **fields,
    )


def chat(url: str, max_tokens: int, timeout: float = 120) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=timeout,
    )


def test_stopping_a_stack_answers_every_request_it_admitted(tmp_path, monkeypatch):
    # The decoder takes two requests at a time, so when the stack is stopped some
    # requests still wait in the queue and some handoffs for the decoder. Stopped
    # at once, the engines left them there, and those clients were cut off.
    engine_args = ("--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "2")
    up = config(tmp_path, monkeypatch, mode="disaggregated", engine_args=engine_args)
    stack = Stack(up).start(say=lambda line: None)
    try:
        with ThreadPoolExecutor(8) as pool:
            replies = [pool.submit(chat, stack.url, 120) for _ in range(8)]
            time.sleep(0.3)  # all admitted, most waiting for an engine
            started = time.monotonic()
            stack.stop()
            took = time.monotonic() - started
            answers = [r.result() for r in replies]
    finally:
        stack.stop()
    for reply in answers:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 120
    assert took < 55, f"stop took {took:.0f} s: something waited out the deadline"


def test_a_redis_that_dies_is_restarted_and_the_stack_serves_again(tmp_path, monkeypatch):
    with running_stack(config(tmp_path, monkeypatch)) as stack:
        assert chat(stack.url, 4).status_code == 200
        port = stack.redis.port
        stack.redis.kill()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if stack.redis.alive:
                reply = chat(stack.url, 4, timeout=30)
                if reply.status_code == 200:
                    break
            time.sleep(0.5)
        else:
            pytest.fail("the stack did not serve again within 90 s of losing Redis")
        assert stack.redis.port == port  # the engines and gateway know that address


def test_a_crash_after_a_long_run_restarts_at_once(tmp_path):
    stack = Stack(UpConfig(log_dir=tmp_path))
    child = Child("worker", [sys.executable, "-c", "pass"], tmp_path / "w.log", "", True)
    child.start()
    child.process.wait()
    said: list[str] = []
    child.restarts = 5  # a crash loop long ago: 30 s between starts
    child.started_at = time.monotonic() - STABLE_AFTER_S - 1
    stack._restart_if_dead(child, said.append)
    assert said == ["worker exited (0); restarting in 1s"]
    child.next_start = 0.0
    child.started_at = time.monotonic()  # died at once this time: backoff grows
    child.restarts = 5
    stack._restart_if_dead(child, said.append)
    assert said[-1] == "worker exited (0); restarting in 30s"
