"""`tandem up` as a supervisor: stopping in order, Redis restarted, hung and crashing children,
a start that fails."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from support.polling import eventually
from support.stacks import running_stack

from tandem.backlog import enqueue, queue_depth
from tandem.child import STABLE_AFTER_S, Child
from tandem.demo import AnswerError, stream_chat
from tandem.embedded_redis import restart_if_dead, start_embedded
from tandem.engine.service.work_queue import WorkQueue
from tandem.keys import Keys
from tandem.preflight import StartError
from tandem.protocol import Role, WorkItem
from tandem.redis_server import RedisServer, free_port
from tandem.up import HURRY_S, Stack, UpConfig

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
    _stop_while_serving(stack, requests=8, tokens=120)  # most waiting for an engine


def test_a_served_name_that_json_escapes_is_served(tmp_path, monkeypatch):
    # The wait for the gateway to list the model looked for the name in the raw JSON,
    # where a backslash or a quote is escaped: the start failed after --ready-timeout.
    name = 'team\\"tiny"'
    up = config(tmp_path, monkeypatch)
    # And the gateway's own flags reach it (--gateway-args): a default of 3 tokens.
    gateway_args = ("--default-max-tokens", "3")
    up = dataclasses.replace(
        up, served_model_name=name, ready_timeout=60.0, gateway_args=gateway_args
    )
    stack = Stack(up).start(say=lambda line: None)
    try:
        answer = httpx.post(
            f"{stack.url}/v1/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": name, "prompt": "hi", "max_tokens": 2},
            timeout=60,
        )
        unbounded = httpx.post(
            f"{stack.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": name, "messages": [{"role": "user", "content": "hi"}],
                  "ignore_eos": True},
            timeout=60,
        )  # fmt: skip
    finally:
        stack.stop(say=lambda line: None)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == name
    assert unbounded.json()["usage"]["completion_tokens"] == 3, unbounded.text


def test_a_redis_given_from_outside_is_said_at_start(tmp_path, monkeypatch, redis_url):
    # Only the embedded one was said: an exported $TANDEM_REDIS_URL attached the stack to
    # a shared Redis in silence.
    up = dataclasses.replace(config(tmp_path, monkeypatch), redis_url=redis_url)
    said: list[str] = []
    stack = Stack(up).start(say=said.append)
    stack.stop(say=lambda line: None)
    assert "redis      redis://127.0.0.1:" in said[0] and said[0].endswith(
        "(--redis-url, or $TANDEM_REDIS_URL)"
    ), said


def test_an_engine_dead_as_the_stack_stops_is_restarted_to_answer_what_was_admitted(
    tmp_path, monkeypatch
):
    # Supervision ended with the stop: the dead engine stayed dead, the queue was never
    # served, and every client waited out the 60 s deadline to be cut off.
    engine_args = ("--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "2")
    stack = Stack(config(tmp_path, monkeypatch, engine_args=engine_args)).start(
        say=lambda line: None
    )
    engines = [c for c in stack.children if c is not stack.gateway]
    # 200 tokens: long enough that all four are held at once on a loaded machine (with
    # 60 the first two could end before the last connected, under a CI's two workers).
    _stop_while_serving(stack, requests=4, tokens=200, first=lambda: engines[0].kill())


def test_a_hurried_stop_ends_open_streams_with_an_error_event(tmp_path, monkeypatch):
    # Ctrl-C twice: the gateway was killed a few seconds on, its streams cut bare (the
    # SDKs' "Connection error."), where its own cut ends each with an error event.
    stack = Stack(config(tmp_path, monkeypatch)).start(say=lambda line: None)
    engine = next(c for c in stack.children if c is not stack.gateway)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 200, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    stopping = threading.Thread(target=stack.stop, kwargs={"say": lambda line: None})
    try:
        with httpx.stream(
            "POST", f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=60
        ) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            engine.process.send_signal(signal.SIGSTOP)  # the answer stops coming
            stack.request_stop()
            stack.request_stop()  # Ctrl-C again
            stopping.start()
            rest = "\n".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            engine.process.send_signal(signal.SIGCONT)
        if stopping.is_alive():
            stopping.join()
        stack.stop()
    assert '"code":"shutting_down"' in rest.replace(" ", ""), rest[-500:]


def _stop_while_serving(stack: Stack, requests: int, tokens: int, first=None) -> None:
    """Stop the stack with `requests` chat requests admitted (after `first()`); each must
    be answered whole, the stop within its deadline."""
    try:
        with ThreadPoolExecutor(requests) as pool:
            replies = [pool.submit(chat, stack.url, tokens) for _ in range(requests)]
            _wait_in_flight(stack.url, requests)
            if first is not None:
                first()
            started = time.monotonic()
            stack.stop(say=lambda line: None)
            took = time.monotonic() - started
            answers = [r.result() for r in replies]
    finally:
        stack.stop()
    for reply in answers:
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == tokens
    assert took < 55, f"stop took {took:.0f} s: something waited out the deadline"


def _wait_in_flight(url: str, count: int, timeout: float = 30) -> None:
    """Until the gateway holds `count` chat requests (a fixed sleep missed some on a
    loaded machine, and a client not yet connected at stop is refused, not answered)."""
    pattern = re.compile(
        r'^tandem_gateway_requests_in_flight\{route="/v1/chat/completions"\} (\S+)$', re.M
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.search(httpx.get(f"{url}/metrics", timeout=10).text)
        if found and float(found.group(1)) >= count:
            return
        time.sleep(0.05)
    pytest.fail(f"the gateway never held {count} requests at once")


def test_a_redis_that_dies_is_restarted_and_the_stack_serves_again(tmp_path, monkeypatch):
    with running_stack(config(tmp_path, monkeypatch)) as stack:
        assert chat(stack.url, 4).status_code == 200
        # It restarts the model's engines, so it declares the model (tandem/catalog.py):
        # a gateway queues requests while an engine restarts, whatever roles are live.
        client = redis.Redis.from_url(stack.redis_url)
        assert eventually(lambda: client.exists(Keys().model_key("tiny")))
        client.close()
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


def test_the_embedded_redis_keeps_queued_requests_across_its_crash(tmp_path):
    # Restarted empty, it lost every queued request, and `tandem up` said so; with its
    # append-only file it comes back with them, taken (pending) or waiting alike.
    stack = Stack(UpConfig(log_dir=tmp_path))
    stack._start_redis()
    client = redis.Redis.from_url(stack.redis_url)
    try:
        for rid in ("running", "queued"):
            enqueue(client, Keys(), WorkItem(rid, "m", prompt_token_ids=[1, 2]))
        assert len(WorkQueue(client, Keys(), "m", Role.NORMAL, "engine").pull(1).work) == 1
        # Written to the file: with appendfsync everysec, a busy disk lets Redis hold
        # its last writes back up to 2 s (what `tandem up` says it may lose).
        assert eventually(lambda: client.info("persistence")["aof_buffer_length"] == 0, 5)
        stack.redis.kill()
        said: list[str] = []
        assert restart_if_dead(stack.redis, said.append) is None
        assert "append-only file (queued requests are kept" in said[0]
        depth = queue_depth(client, Keys(), "m")
        assert (depth.total_waiting, depth.pending) == (1, 1)
        # Its file deleted meanwhile, it comes back empty, and says so.
        stack.redis.kill()
        (stack.redis.data_dir / "appendonly.aof").unlink()
        assert restart_if_dead(stack.redis, said.append) is None
        assert "empty: its append-only file is gone" in said[1]
        assert queue_depth(client, Keys(), "m").total_waiting == 0
    finally:
        client.close()
        stack.stop()
    # A new run in the same folder starts empty: the old run's clients are gone.
    again = Stack(UpConfig(log_dir=tmp_path))
    again._start_redis()
    try:
        with redis.Redis.from_url(again.redis_url) as client:
            assert queue_depth(client, Keys(), "m").total_waiting == 0
    finally:
        again.stop()


def test_an_engine_that_stops_answering_is_killed_and_restarted(tmp_path, monkeypatch):
    with running_stack(config(tmp_path, monkeypatch)) as stack:
        engine = next(c for c in stack.children if c is not stack.gateway)
        engine.liveness_period_s, engine.liveness_failures = 0.5, 3  # 10 s and 6 in a pod
        hung = engine.process
        time.sleep(1.5)  # a probe sees it ready: from now on it is probed
        hung.send_signal(signal.SIGSTOP)  # alive, but answers nothing
        try:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                if engine.process is not hung and engine.ready():
                    break
                time.sleep(0.5)
            else:
                pytest.fail("the hung engine was not replaced within 90 s")
        finally:
            hung.send_signal(signal.SIGCONT)
        assert hung.poll() is not None  # killed, not left stopped
        assert chat(stack.url, 4).status_code == 200


def test_a_child_that_cannot_restart_is_tried_again_not_the_end_of_the_stack(tmp_path):
    # Its log folder deleted, an engine's restart raised out of supervision and took the
    # gateway and Redis down with it. The folder is made again; a log that cannot be
    # opened at all is said, and tried again after the backoff.
    gone = tmp_path / "removed" / "w.log"
    child = Child("worker", [sys.executable, "-c", "pass"], gone, "", True)
    child.start()
    child.process.wait()
    shutil.rmtree(tmp_path / "removed")
    child.next_start = time.monotonic() - 1  # due
    child.supervise(time.monotonic())
    assert gone.exists()  # restarted, its folder made again
    child.process.wait()
    blocked = tmp_path / "file"
    blocked.write_text("")
    child.log_path = blocked / "w.log"  # under a file: cannot be made
    child.next_start = time.monotonic() - 1
    said = child.supervise(time.monotonic())
    assert said and said[-1].startswith("worker could not restart: ")
    said = child.supervise(time.monotonic())  # then after a backoff, as any failed start
    assert said and said[-1].startswith("worker exited (0); restarting in 4s")


def test_ctrl_c_while_waiting_for_the_model_to_be_listed_stops_at_once(tmp_path, monkeypatch):
    # Its last wait while starting did not look at the stop: Ctrl-C there waited out
    # --ready-timeout (300 s by default).
    stack = Stack(config(tmp_path, monkeypatch))  # nothing started: nothing lists it
    try:
        stack.request_stop()
        with pytest.raises(KeyboardInterrupt):
            stack._wait_ready(print, [])  # no child to wait for: the model's wait next
    finally:
        stack.stop()


def test_two_stacks_never_share_a_run_folder(tmp_path, monkeypatch):
    # Both Redis wrote one append-only file; one's restart loaded the other's data.
    first = Stack(config(tmp_path, monkeypatch))
    try:
        with pytest.raises(ValueError, match="is in use by another running `tandem up`"):
            Stack(config(tmp_path, monkeypatch))
    finally:
        first.stop()
    Stack(config(tmp_path, monkeypatch)).stop()  # free once the first stopped


def test_the_restart_backoff_grows_in_a_crash_loop_and_resets_after_a_long_run(tmp_path):
    child = Child("worker", [sys.executable, "-c", "pass"], tmp_path / "w.log", "", True)
    now = time.monotonic()
    child.restarts, child.started_at = 5, now - 1  # died at once, the sixth time
    assert child.backoff(now) == 30
    child.restarts, child.started_at = 5, now - STABLE_AFTER_S - 1
    assert child.backoff(now) == 1
    assert child.restarts == 0


def test_a_dead_child_is_restarted_after_its_backoff_and_says_why_it_failed(tmp_path):
    exits = "import sys; print('starting'); sys.exit('tandem: error: no such model')"
    child = Child("worker", [sys.executable, "-c", exits], tmp_path / "w.log", "", True)
    child.start()
    child.process.wait()
    assert child.supervise(time.monotonic()) == [
        "worker exited (1: no such model); restarting in 1s"
    ]
    first = child.process
    assert child.supervise(time.monotonic()) == []  # within the backoff
    assert child.process is first
    child.next_start = time.monotonic()  # the backoff is over
    assert child.supervise(time.monotonic()) == []
    assert child.process is not first and child.restarts == 1
    child.process.wait()
    # Killed: its log's last line is about something else.
    child.argv = [sys.executable, "-c", "import os; print('serving'); os.kill(os.getpid(), 9)"]
    child.next_start = 0.0
    child.start()
    child.process.wait()
    assert child.supervise(time.monotonic()) == [
        "worker exited (-9: killed by SIGKILL); restarting in 2s"
    ]


def test_a_failed_start_stops_everything_and_keeps_the_log_that_says_why(monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    # No log_dir: a temporary one, which stop() removes, but not after a failed start.
    up = UpConfig(model="random:tiny", port=free_port(), engine_args=("--no-such-flag",))
    stack = Stack(up)
    try:
        with pytest.raises(StartError) as failed:
            stack.start(say=lambda line: None)
        log = stack.log_dir / "engine-normal.log"
        assert re.fullmatch(
            rf"normal engine exited while starting \(2: .*--no-such-flag; "
            rf"details in {re.escape(str(log))}\)",
            str(failed.value),
        )
        assert "--no-such-flag" in log.read_text()
        assert not any(child.alive for child in stack.children)
        assert stack.redis is None  # stopped too
    finally:
        shutil.rmtree(stack.log_dir, ignore_errors=True)


@pytest.mark.parametrize(
    ("log", "reason"),
    [
        ("loading\ntandem: error: model 'x' is no such file\n", "model 'x' is no such file"),
        (  # uvicorn's
            "INFO:     Started\nERROR:    [Errno 98] address already in use\n"
            "INFO:     Waiting for application shutdown.\n",
            "[Errno 98] address already in use",
        ),
        (
            'Traceback (most recent call last):\n  File "x.py", line 1\n'
            "redis.exceptions.ConnectionError: Error 111 connecting\n\n",
            "redis.exceptions.ConnectionError: Error 111 connecting",
        ),
        ("Killed\n", "Killed"),
        ("", "its log is empty"),
    ],
    ids=["tandem-error", "uvicorn-error", "traceback", "last-line", "empty"],
)
def test_the_reason_a_child_exited_is_the_line_of_its_log_that_says_it(tmp_path, log, reason):
    (tmp_path / "c.log").write_text(log)
    assert Child("c", [], tmp_path / "c.log", "", True).last_error() == reason


def test_the_reason_is_of_this_start_and_says_its_exit_status(tmp_path):
    # A reused --log-dir: "exited while starting" quoted an earlier run's error line, and
    # never said how the process ended.
    log = tmp_path / "c.log"
    log.write_text("tandem: error: an earlier run's error\n")

    def exited(code: str) -> Child:
        child = Child("c", [sys.executable, "-c", code], log, "", True)
        child.start()
        child.process.wait(30)
        return child

    assert exited("import sys; sys.exit(3)").exit_reason() == "3: its log is empty"
    assert exited("import os; os.kill(os.getpid(), 9)").exit_reason() == "-9: killed by SIGKILL"
    assert exited("raise SystemExit('tandem: error: now')").exit_reason() == "1: now"


def test_a_request_sent_while_the_engine_loads_waits_for_it(tmp_path, monkeypatch):
    # The gateway is up in a second, a model's engine can take minutes: tandem up
    # declares its model at once, so such a request waits instead of a 404.
    stack = Stack(config(tmp_path, monkeypatch))
    engine = stack._engine

    def slow_engine(role, threads):  # an engine that loads for 5 s more
        child = engine(role, threads)
        delay = (
            "import os, sys, time; time.sleep(5); "
            "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
        )
        child.argv = [sys.executable, "-c", delay, *child.argv[1:]]
        return child

    monkeypatch.setattr(stack, "_engine", slow_engine)
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(stack.start, say=lambda line: None)
        try:
            url = f"http://127.0.0.1:{stack.config.port}"
            assert eventually(lambda: _answers(f"{url}/readyz"), timeout=30)
            assert not started.done()  # the engine is still loading
            reply = chat(url, 4)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
            started.result(timeout=60)
        finally:
            stack.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _serving_child(tmp_path, status: str, after_s: float = 0.0) -> Child:
    """An engine-like child: an HTTP server from `after_s` on, answering `status` (a
    Python expression of the request `s`) at every path."""
    port = free_port()
    serve = (
        f"import time, http.server as h; time.sleep({after_s}); "
        f"h.HTTPServer(('127.0.0.1', {port}), type('H', (h.BaseHTTPRequestHandler,), "
        f"{{'do_GET': lambda s: (s.send_response({status}), s.end_headers()), "
        "'log_message': lambda *a: None})).serve_forever()"
    )
    url = f"http://127.0.0.1:{port}"
    return Child("engine", [sys.executable, "-c", serve], tmp_path / "e.log", f"{url}/readyz",
                 True, live_url=f"{url}/healthz")  # fmt: skip


def test_a_child_is_said_ready_once_after_each_start(tmp_path):
    # Only the stack's first start said "ready": an engine restarted or started by
    # a scale-up came back in silence, after "restarting in 1s" or "starting".
    child = _serving_child(tmp_path, "200", after_s=0.5)
    child.start()
    try:
        assert child.supervise(time.monotonic()) == []  # loading
        said: list[str] = []
        assert eventually(lambda: said.extend(child.supervise(time.monotonic())) or said, 10)
        assert said == ["engine     ready"]
        assert child.supervise(time.monotonic()) == []  # said once
        child.kill()
        assert child.supervise(time.monotonic())[0].startswith("engine exited (-9")
        child.next_start = time.monotonic()  # its backoff over: started again
        child.supervise(time.monotonic())
        said.clear()
        assert eventually(lambda: said.extend(child.supervise(time.monotonic())) or said, 10)
        assert said == ["engine     ready"]
    finally:
        child.kill()


def test_children_are_asked_directly_whatever_proxy_the_environment_names(tmp_path, monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    child = _serving_child(tmp_path, "200")
    child.start()
    try:
        deadline = time.monotonic() + 10
        while not child.ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child.ready(), "asked through the proxy, it never answered"
    finally:
        child.kill()


@contextlib.contextmanager
def stand_in_gateway(status: int, events: list[dict]) -> Iterator[str]:
    """A server answering every POST with `status` and `events` as a stream (a JSON
    body if not 200): its URL."""
    if status == 200:
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    else:
        body = json.dumps(events[0])

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass  # http.server logs every request to stderr

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()


def test_the_demo_asks_its_gateway_directly_whatever_proxy_the_environment_names(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    chunk = {"choices": [{"delta": {"content": "Paris"}}]}
    with stand_in_gateway(200, [chunk]) as url:
        assert "".join(stream_chat(url, "k", "m", "Capital of France?", 4)) == "Paris"


def test_the_demo_says_what_the_gateway_refused_or_what_broke_the_answer_off():
    # A refusal was a traceback; an error event mid-answer was dropped, the cut-off
    # answer then said "answered".
    refusal = {"error": {"message": "The prompt has 15015 tokens, more than 2047"}}
    with stand_in_gateway(400, [refusal]) as url, pytest.raises(AnswerError) as refused:
        list(stream_chat(url, "k", "m", "?", 4))
    assert str(refused.value) == "the gateway answered 400: " + refusal["error"]["message"]
    chunk = {"choices": [{"delta": {"content": "The cap"}}]}
    broke = {"error": {"message": "the engine failed", "code": "engine_error"}}
    pieces = []
    with stand_in_gateway(200, [chunk, broke]) as url, pytest.raises(AnswerError) as cut:
        pieces.extend(stream_chat(url, "k", "m", "?", 4))
    assert pieces == ["The cap"] and str(cut.value) == "the answer broke off: the engine failed"


def _signalled_demo(tmp_path: Path, after: str, signum: int, pause_s: float = 0.0):
    """`tandem demo` on a tiny model (its run folder under tmp_path) sent `signum` pause_s
    after its first stderr line holding `after`: its exit code, and its stderr."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "TANDEM_CPU_KERNELS": "0"}
    demo = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "demo", "--model", "random:tiny"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    said = []
    try:
        for line in demo.stderr:
            said.append(line)
            if after in line:
                time.sleep(pause_s)
                demo.send_signal(signum)
                break
        code = demo.wait(timeout=60)
    finally:
        demo.kill()
    return code, "".join(said) + demo.stderr.read()


def test_ctrl_c_while_the_demo_stops_hurries_the_stop_and_leaves_no_run_folder(tmp_path):
    # The Ctrl-C broke out of the stop: the children were killed undrained, and the run
    # folder, its Redis file holding every prompt and answer, stayed in /tmp.
    # (0.5 s into the stop: its drain takes seconds.)
    code, said = _signalled_demo(tmp_path, "answered in", signal.SIGINT, pause_s=0.5)
    # 130 where the Ctrl-C came before the stop began (a loaded machine): a Ctrl-C then
    # ends the demo, and its stop runs all the same.
    assert code in (0, 130) and "Traceback" not in said, said
    assert not list(tmp_path.glob("tandem-up-*"))


def test_a_sigterm_to_the_demo_stops_it_as_ctrl_c_does(tmp_path):
    # `timeout`, a cancelled CI job: the demo died at once, and left its run folder
    # (every prompt and answer in its Redis file) in /tmp. (Sent once its processes
    # launched.)
    code, said = _signalled_demo(tmp_path, "starting", signal.SIGTERM)
    assert code == 130 and "Traceback" not in said, said
    assert not list(tmp_path.glob("tandem-up-*"))


def test_under_nohup_a_hang_up_leaves_tandem_up_running(tmp_path):
    # Its handler replaced the SIG_IGN nohup set: closing the terminal stopped a server
    # its user had protected.
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0"}
    argv = [sys.executable, "-m", "tandem.cli", "up", "--model", "random:tiny",
            "--port", str(free_port()), "--log-dir", str(tmp_path / "up")]  # fmt: skip
    up = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )  # fmt: skip
    try:
        for line in up.stdout:
            if "starting" in line:
                break
        up.send_signal(signal.SIGHUP)
        time.sleep(1.5)
        assert up.poll() is None, up.stdout.read()
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        finally:
            up.kill()


def test_a_child_is_asked_often_whether_it_is_up_until_it_first_answers(tmp_path):
    # Asked every liveness period (10 s), an engine that hung within that of its
    # start was never seen up, so never probed for liveness: hung for good.
    child = _serving_child(tmp_path, "200", after_s=0.5)
    child.start()
    try:
        deadline = time.monotonic() + 4  # well within one liveness period
        while not child.started_up and time.monotonic() < deadline:
            child.hung(time.monotonic())
            time.sleep(0.1)
        assert child.started_up
    finally:
        child.kill()


def test_a_child_that_hangs_once_said_ready_is_probed_for_liveness(tmp_path):
    # Hung between its readiness answer and the supervisor's first liveness ask, it
    # was never seen up: only the startup deadline (30 minutes) would end it.
    child = _serving_child(tmp_path, "200")
    child.liveness_period_s, child.liveness_failures = 0.1, 2
    child.start()
    try:
        assert eventually(child.newly_ready, 10)
        child.process.send_signal(signal.SIGSTOP)
        said: list[str] = []
        assert eventually(lambda: said.extend(child.supervise(time.monotonic())) or said, 20)
        assert said[0].startswith("engine stopped answering")
    finally:
        child.kill()


def test_a_child_that_never_answers_within_its_startup_deadline_is_restarted(tmp_path):
    # Hung before its first readiness answer (or between two asks), a child was never
    # probed for liveness: it hung for good. A pod's startupProbe bounds that wait.
    url = f"http://127.0.0.1:{free_port()}"  # nothing answers there
    child = Child("engine", [sys.executable, "-c", "import time; time.sleep(60)"],
                  tmp_path / "e.log", f"{url}/readyz", True, live_url=f"{url}/healthz",
                  startup_deadline_s=0.5)  # fmt: skip
    child.start()
    stuck = child.process
    try:
        said = child.supervise(time.monotonic())
        assert said == [] and stuck.poll() is None  # within its deadline
        time.sleep(0.6)
        child._next_probe = 0.0  # the next startup ask is due
        said = child.supervise(time.monotonic())
        assert said[0] == f"engine did not answer {url}/healthz 0.5 s after its start; killing it"
        assert stuck.poll() is not None
        assert said[1].startswith("engine exited (-9: killed by SIGKILL); restarting in")
    finally:
        child.kill()


def test_a_child_up_but_not_ready_is_not_restarted_at_its_startup_deadline(tmp_path):
    # As a pod: an engine that cannot reach Redis answers /healthz, not /readyz; a
    # restart (a model load) every 30 minutes would not bring Redis back.
    child = _serving_child(tmp_path, "200 if s.path == '/healthz' else 503")
    child.startup_deadline_s = 0.5
    child.start()
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            assert child.supervise(time.monotonic()) == []
            time.sleep(0.1)
        assert child.started_up and not child.ready()
    finally:
        child.kill()


def from_zero(tmp_path, monkeypatch, **spec) -> UpConfig:
    """A ModelDeployment of random:tiny autoscaled from zero: nothing loads at start."""
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")
    manifest = {
        "apiVersion": "serving.tandem.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {"path": "random:tiny"},
            "normal": {"minReplicas": 0, "maxReplicas": 1},
            **spec,
        },
    }
    manifest["spec"] = {k: v for k, v in manifest["spec"].items() if v is not None}
    return UpConfig(manifest=manifest, port=free_port(), api_key=API_KEY, log_dir=tmp_path / "up")


SPLIT_FROM_ZERO = {
    "mode": "Disaggregated",
    "normal": None,
    "prefill": {"minReplicas": 0, "maxReplicas": 1},
    "decode": {"minReplicas": 1, "maxReplicas": 1},
}


@pytest.mark.parametrize("roles", [{}, SPLIT_FROM_ZERO], ids=["normal", "prefill-only-at-zero"])
def test_stopping_with_a_role_at_zero_answers_the_work_it_admitted(tmp_path, monkeypatch, roles):
    # minReplicas 0 and no engine yet: stopped just after a request was admitted, the
    # stack started none for it, and the client waited the whole stop timeout for nothing;
    # with a decoder up, the prefill role at zero was never started either.
    up = from_zero(tmp_path, monkeypatch, engine={"maxModelLen": 256}, **roles)
    stack = Stack(up).start(say=lambda line: None)
    try:
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(chat, stack.url, 8)
            _wait_in_flight(stack.url, 1)
            started = time.monotonic()
            stack.stop()
            took = time.monotonic() - started
            answer = reply.result()
    finally:
        stack.stop()
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8
    assert took < 45, f"stop took {took:.0f} s"


def test_a_manifests_cluster_redis_is_said_to_be_unused(tmp_path, monkeypatch):
    # A manifest copied from a cluster names the cluster's Redis: it was ignored in
    # silence, and the stack served on its own.
    said: list[str] = []
    up = from_zero(
        tmp_path, monkeypatch, redis={"url": "redis://tandem-redis.tandem-system:6379/0"}
    )
    Stack(up).start(say=said.append).stop()
    assert "redis      spec.redis is a cluster's: here --redis-url is, else an embedded one" in said


def test_a_stop_waits_only_for_requests_that_still_wait_for_an_answer(redis_client, keys):
    # Its only entry was a request already answered 504 (its engine crash-looping): the
    # stop waited the whole minute for nobody.
    from tandem.backlog import answers_owed
    from tandem.engine.service.cancellation import cancel

    now = time.time()

    def owed() -> bool:
        return answers_owed(redis_client, keys, "m", time.time())

    assert not owed()
    enqueue(redis_client, keys, WorkItem("late", "m", prompt_token_ids=[1], deadline=now - 1))
    assert not owed()  # answered 504 by the gateway
    enqueue(redis_client, keys, WorkItem("open", "m", prompt_token_ids=[1], deadline=now + 60))
    assert owed()
    cancel(redis_client, keys, "open")  # its client left
    assert not owed()
    enqueue(redis_client, keys, WorkItem("forever", "m", prompt_token_ids=[1]))
    assert owed()
    # Read a page at a time: a live request behind a long run of ended ones is found.
    for i in range(150):
        late = WorkItem(f"late-{i}", "n", prompt_token_ids=[1], deadline=now - 1)
        enqueue(redis_client, keys, late)
    assert not answers_owed(redis_client, keys, "n", time.time())
    enqueue(redis_client, keys, WorkItem("last", "n", prompt_token_ids=[1], deadline=now + 60))
    assert answers_owed(redis_client, keys, "n", time.time())


def test_ctrl_c_again_while_the_engines_drain_cuts_the_stop_short(tmp_path, monkeypatch):
    # Only a second stop request during the queue's wait shortened the stop: one during
    # the engines' drain waited out the whole minute.
    stack = Stack(config(tmp_path, monkeypatch))
    deaf = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('deaf', flush=True); time.sleep(600)"
    )
    engine = Child("engine", [sys.executable, "-c", deaf], tmp_path / "e.log", "", True)
    engine.start()
    assert eventually(lambda: "deaf" in engine.log_path.read_text(), 30)
    stack.children.append(engine)  # drains for ever: only a kill ends it
    stopping = threading.Thread(target=stack.stop)
    started = time.monotonic()
    stopping.start()
    time.sleep(1.0)  # the engine signalled, its drain under way
    stack.request_stop()  # Ctrl-C again (stop() was the first)
    stopping.join(30)
    assert not stopping.is_alive() and engine.process.poll() is not None
    assert 1.0 + HURRY_S - 0.5 < time.monotonic() - started < 1.0 + HURRY_S + 3


def test_the_embedded_redis_asks_a_password_that_no_command_line_shows(tmp_path):
    # Without one, any user of the machine could read every prompt and answer on
    # 127.0.0.1, and queue work past the gateway's API key.
    server = start_embedded(tmp_path / "redis")
    try:
        with redis.Redis(port=server.port) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        cmdline = Path(f"/proc/{server._process.pid}/cmdline").read_bytes()
        assert server.password and server.password.encode() not in cmdline
        with redis.Redis.from_url(server.url) as client:
            client.xadd("prompts", {"text": "a secret prompt"})  # in its append-only file
        # Owner only: its folder, its password, and the data (every prompt and answer).
        folder = tmp_path / "redis"
        assert folder.stat().st_mode & 0o077 == 0
        for name in ("redis.conf", "appendonly.aof", "redis.log"):
            assert (folder / name).stat().st_mode & 0o077 == 0, name
        server.kill()  # restarted after a crash, it asks the same password
        assert restart_if_dead(server, print) is None
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
    finally:
        server.stop()


def test_a_hurried_stop_says_it_cuts_requests_still_owed_an_answer(tmp_path, monkeypatch):
    # A second Ctrl-C cut them (their clients saw a connection close) without a word.
    with RedisServer() as server:
        stack = Stack(config(tmp_path, monkeypatch, redis_url=server.url))
        with redis.Redis.from_url(server.url) as client:
            owed = WorkItem("open", "tiny", prompt_token_ids=[1], deadline=time.time() + 60)
            enqueue(client, Keys(), owed)  # no engine: it stays owed
        gateway = Child("gateway", [sys.executable, "-c", "import time; time.sleep(60)"],
                        tmp_path / "g.log", "", True)  # fmt: skip
        gateway.start()
        stack.gateway = gateway
        stack.children.append(gateway)
        said: list[str] = []
        stack.children.append(Child("engine", [sys.executable, "-c", "import time; "
                              "time.sleep(60)"], tmp_path / "e.log", "", True))  # fmt: skip
        stack.children[-1].start()
        stopping = threading.Thread(target=stack.stop, kwargs={"say": said.append})
        stopping.start()
        time.sleep(1.0)  # waiting for the queue to empty
        stack.request_stop()  # Ctrl-C again
        stopping.join(30)
        assert not stopping.is_alive()
    assert "stopping sooner (Ctrl-C again): requests still owed an answer are cut" in said, said
