"""The factory, the settings, the OpenAPI schema, and the `tandem gateway` command."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from support.imports import modules_loaded, packages_loaded
from support.ipv6 import ipv6_loopback
from support.polling import eventually

from tandem import catalog
from tandem.cli import build_parser
from tandem.gateway.app import create_app
from tandem.gateway.settings import GatewaySettings
from tandem.protocol import PRIORITY_NORMAL, ResponseEvent, WorkItem
from tandem.redis_server import RedisServer, free_port


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"port": 70000}, "port"),
        ({"key_prefix": "a{b}"}, "key_prefix"),
        ({"max_queue": -1}, "max_queue"),
        ({"request_timeout": 0}, "request_timeout"),
        ({"request_timeout": float("inf")}, "request_timeout"),
        ({"max_body_bytes": 10}, "max_body_bytes"),
        ({"read_block_ms": 5000}, "read_block_ms"),
        ({"no_auth": True, "api_keys_file": "k.json"}, "contradict"),
    ],
)
def test_bad_settings_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        GatewaySettings(**fields)


def test_the_app_needs_keys_unless_open(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEYS", raising=False)
    with pytest.raises(ValueError, match="no API keys"):
        create_app(GatewaySettings())
    monkeypatch.setenv("TANDEM_API_KEYS", "sk-a,sk-b")
    assert len(create_app(GatewaySettings()).state.gateway.key_store) == 2
    assert create_app(GatewaySettings(no_auth=True)).state.gateway.key_store.open_access


def test_the_schema_documents_errors_as_openai_bodies_and_no_422(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS", "sk-a")
    schema = create_app(GatewaySettings()).openapi()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    # Every status of the docs' error table (docs/gateway.md).
    statuses = ("400", "401", "403", "404", "408", "409", "413", "415", "429", "500", "503", "504")
    for status in statuses:
        ref = chat["responses"][status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    assert chat["security"] and "securitySchemes" in schema["components"]
    open_schema = create_app(GatewaySettings(no_auth=True)).openapi()
    assert "security" not in open_schema["paths"]["/v1/chat/completions"]["post"]


def test_help_imports_no_web_stack():
    code = (
        "from tandem.cli import build_parser; build_parser().parse_args(['gateway', '--no-auth'])"
    )
    web = {"fastapi", "uvicorn", "starlette", "pydantic", "torch"}
    assert packages_loaded(code, web) == []


def test_the_flags_default_to_the_settings_defaults(monkeypatch):
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    args = build_parser().parse_args(["gateway"])
    assert GatewaySettings.from_args(args) == GatewaySettings()


def test_the_gateway_imports_of_the_engine_only_sampling_params():
    # tandem/protocol.py's contract; and the gateway's image has no torch.
    loaded = modules_loaded("import tandem.gateway.app, tandem.gateway.main")
    engine = [m for m in loaded if m.startswith("tandem.engine") or m in ("torch", "numpy")]
    assert engine == ["tandem.engine", "tandem.engine.request"]


def _gateway_answering(process: subprocess.Popen, port: int, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"http://{host}:{port}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)


def test_tandem_gateway_serves_and_stops_on_sigterm(redis_url, keys):
    port = free_port()
    cmd = [
        sys.executable, "-m", "tandem.cli", "gateway", "--no-auth",
        "--host", "127.0.0.1", "--port", str(port),
        "--redis-url", redis_url, "--key-prefix", keys.prefix,
    ]  # fmt: skip
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _gateway_answering(process, port)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").json() == {"status": "ready"}
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models == {"object": "list", "data": []}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
def test_in_a_pod_of_an_ipv6_cluster_every_interface_is_ipv6(redis_url, keys):
    # The chart's --host=0.0.0.0 listened on IPv4 alone: a pod with an IPv6 address
    # only was refused its probes and its Service's traffic, and never became ready.
    port = free_port()
    cmd = [
        sys.executable, "-m", "tandem.cli", "gateway", "--no-auth", "--host", "0.0.0.0",
        "--port", str(port), "--redis-url", redis_url, "--key-prefix", keys.prefix,
    ]  # fmt: skip
    env = {**os.environ, "POD_IP": "fd00::7"}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        _gateway_answering(process, port, host="[::1]")
    finally:
        process.kill()
        process.wait()


def _quick_to_stop_gateway(
    redis_url, keys, port: int, auth: tuple[str, ...] = ("--no-auth",)
) -> subprocess.Popen[str]:
    """`tandem gateway` with a 1 s shutdown timeout, its output in one pipe."""
    cmd = [
        sys.executable, "-m", "tandem.cli", "gateway", *auth, "--shutdown-timeout", "1",
        "--host", "127.0.0.1", "--port", str(port),
        "--redis-url", redis_url, "--key-prefix", keys.prefix,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _cut_by_the_stop(
    process: subprocess.Popen[str], port: int, redis_client, keys, asks: list[tuple[dict, dict]]
) -> tuple[list[httpx.Response], str]:
    """Each ask (body, headers) posted to the idle model (no engine) and queued, then the
    gateway stopped: their answers, and the gateway's output."""
    try:
        _gateway_answering(process, port)
        catalog.declare(redis_client, keys, "idle", "test/idle", ttl_s=60)
        url = f"http://127.0.0.1:{port}/v1/completions"
        with ThreadPoolExecutor(len(asks)) as pool:
            asked = [
                pool.submit(httpx.post, url, json=body, headers=headers, timeout=30)
                for body, headers in asks
            ]
            stream = keys.work_stream("idle", PRIORITY_NORMAL)
            assert eventually(lambda: redis_client.xlen(stream) == len(asks))
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
            answers = [answer.result() for answer in asked]
        return answers, process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_requests_cut_by_the_shutdown_timeout_are_answered_503_and_log_one_line_each(
    redis_url, redis_client, keys
):
    # An alert on ERROR lines paged on every stop with a request open: uvicorn logged
    # the cancellation as "Exception in ASGI application" and a traceback.
    port = free_port()
    process = _quick_to_stop_gateway(redis_url, keys, port)
    body = {"model": "idle", "prompt": "hi", "max_tokens": 2}
    asks = [({**body, "stream": stream}, {}) for stream in (False, True)]
    answers, output = _cut_by_the_stop(process, port, redis_client, keys, asks)
    assert "Traceback" not in output and "CancelledError" not in output, output
    # Worded as the server's own line for a stream cut.
    assert output.count("a request still open at the shutdown timeout (1s) was cut") == 2
    # Neither had started its answer: each gets an error an SDK can show and retry,
    # not the server's plain-text 500 ("Internal Server Error").
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "shutting_down"
        assert answer.headers["retry-after"] == "1"


def test_a_request_the_stop_cut_before_its_answer_gives_its_quota_back(
    redis_url, redis_client, keys, tmp_path
):
    # The 503 shutting_down asks for a retry (the SDKs make it, as a new request), but
    # the cut attempt kept its charge: on a key of 1 request a minute the retry met 429.
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "sk-one", "name": "one", "rpm": 1, "tpm": 1000}]))
    port = free_port()
    process = _quick_to_stop_gateway(redis_url, keys, port, ("--api-keys-file", str(path)))
    body = {"model": "idle", "prompt": "hi", "max_tokens": 2}
    asks = [(body, {"Authorization": "Bearer sk-one"})]
    (answer,), _ = _cut_by_the_stop(process, port, redis_client, keys, asks)
    assert answer.status_code == 503
    (marker,) = redis_client.keys(f"{keys.prefix}:quota:*:taken:*")
    assert redis_client.get(marker) == b"given back"


def test_a_stream_cut_by_the_shutdown_timeout_ends_with_an_error_event(
    redis_url, redis_client, keys
):
    # Cut bare, its client saw the connection drop ("Connection error." in the SDKs), as
    # for a gateway that crashed; and uvicorn said so at ERROR on every such stop.
    port = free_port()
    process = _quick_to_stop_gateway(redis_url, keys, port)
    try:
        _gateway_answering(process, port)
        catalog.declare(redis_client, keys, "idle", "test/idle", ttl_s=60)
        body = {"model": "idle", "prompt": "hi", "max_tokens": 50, "stream": True}
        url = f"http://127.0.0.1:{port}/v1/completions"

        def first_token() -> None:  # as an engine writes it: the stream's answer starts
            stream = keys.work_stream("idle", PRIORITY_NORMAL)
            assert eventually(lambda: redis_client.xlen(stream) == 1)
            [(_, fields)] = redis_client.xrange(stream)
            rid = WorkItem.from_fields(fields).request_id
            first = ResponseEvent.tokens(0, [7], "hi", "engine-x")
            redis_client.xadd(keys.response_stream(rid), first.to_fields())

        engine = threading.Thread(target=first_token)
        engine.start()
        with httpx.stream("POST", url, json=body, timeout=30) as answer:
            engine.join()
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).count('"hi"')
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert process.wait(timeout=15) == 0
        output = process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert json.loads(rest[-1].removeprefix("data: "))["error"]["code"] == "shutting_down", rest
    assert " ERROR " not in output and "Traceback" not in output, output
    assert "a stream still open at the shutdown timeout was cut" in output


def test_a_sigterm_before_the_server_took_over_ends_the_gateway(monkeypatch, redis_url):
    # tandem up stops a stack whose engine failed to start while the gateway may still
    # be starting: a SIGTERM between main's own handler and uvicorn's must not be lost.
    import uvicorn

    from tandem.gateway import main as gateway_main

    served = []

    def run(server: uvicorn.Server, *_args) -> None:
        signal.raise_signal(signal.SIGTERM)  # before uvicorn installs its handlers
        served.append(server.config.app)  # the server would start and serve on

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(gateway_main.gc, "freeze", lambda: None)  # not in the test process
    args = build_parser().parse_args(["gateway", "--no-auth", "--redis-url", redis_url])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exited:
            gateway_main.main(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exited.value.code == 0 and served == []


def test_a_bad_flag_value_is_an_error_message_not_a_traceback(tmp_path):
    cmd = [sys.executable, "-m", "tandem.cli", "gateway", "--max-queue", "-3", "--no-auth"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "max_queue must be an integer >= 0" in out.stderr and "Traceback" not in out.stderr


def test_a_port_in_use_is_one_error_line_before_the_app_is_built():
    # uvicorn's refusal was its own log line and exit 3, once the app was built.
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = str(taken.getsockname()[1])
        cmd = [sys.executable, "-P", "-m", "tandem.cli", "gateway", "--no-auth", "--port", port]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"tandem: error: port {port} on 0.0.0.0 is already in use (another `tandem up`?): "
        "stop what listens there, or choose another --port"
    ]


def test_without_redis_the_gateway_answers_503_and_is_not_ready(start_gateway):
    gateway = start_gateway(redis_url="redis://127.0.0.1:1/0")  # nothing listens there
    with gateway.http() as client:
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "redis_unreachable"
        reply = client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "redis_unreachable"
    # Its kind, not redis-py's words: they name the cluster's internal address.
    said = reply.json()["error"]["message"]
    assert said == "The gateway cannot reach Redis: the connection failed", said
    # The SDKs wait that long before their retries, not 0.5-1 s: a restarting Redis.
    assert reply.headers["Retry-After"] == "2"


def test_a_redis_refusing_the_password_is_named_and_logged_once(start_gateway, tmp_path, caplog):
    # A password Secret ending in a newline: Redis (and its probe) took "pw\n", the
    # gateway's URL "pw". /readyz said "unreachable", and the log, with no request ever
    # routed to an unready pod, said nothing at all.
    with RedisServer(data_dir=tmp_path / "redis", password="s3cret") as server:
        wrong = start_gateway(redis_url=f"redis://:wrong@127.0.0.1:{server.port}/0")
        none = start_gateway(redis_url=f"redis://127.0.0.1:{server.port}/0")
        with caplog.at_level(logging.INFO, "tandem.gateway"), wrong.http() as client:
            answers = [client.get("/readyz") for _ in range(3)]
            reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        with none.http() as client:
            unasked = client.get("/readyz").json()["error"]["message"]
    assert {a.status_code for a in answers} == {503}
    refused = "Redis refused the password of --redis-url ($TANDEM_REDIS_URL)"
    assert answers[0].json()["error"]["message"] == refused
    assert unasked == "Redis asks for a password, and none is in --redis-url ($TANDEM_REDIS_URL)"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("not ready")]
    assert said == [  # once for the three probes; then the other gateway's
        "not ready: Redis refused the password of --redis-url ($TANDEM_REDIS_URL) "
        f"(Redis at redis://:***@127.0.0.1:{server.port}/0)",
        "not ready: Redis asks for a password, and none is in --redis-url ($TANDEM_REDIS_URL) "
        f"(Redis at redis://127.0.0.1:{server.port}/0)",
    ]
    assert reply.status_code == 503
    assert reply.json()["error"]["message"] == (
        "The gateway cannot reach Redis: Redis refused the gateway's credentials (--redis-url)"
    )


def test_scrapes_share_a_reading_of_redis_a_second_at_most(start_gateway, keys):
    # /metrics needs no key, and each scrape read every model's queues afresh (about a
    # dozen commands a model): anyone could multiply the load on everyone's Redis.
    with RedisServer() as server:
        conn = redis.Redis.from_url(server.url)
        for i in range(5):
            catalog.declare(conn, keys, f"model-{i}", "test/owner", ttl_s=60)
        gateway = start_gateway(redis_url=server.url)

        def commands() -> int:
            return conn.info("stats")["total_commands_processed"]

        with gateway.http() as client:
            time.sleep(1.2)  # past the last reading's second
            before = commands()
            assert client.get("/metrics").status_code == 200
            one = commands() - before - 1  # INFO is one
            assert one >= 5 * 5, "every model's queues read"
            before, started = commands(), time.monotonic()
            for _ in range(50):
                assert client.get("/metrics").status_code == 200
            elapsed = time.monotonic() - started
            used = commands() - before - 1
    assert used <= (elapsed + 2) * one + 20, (used, one, elapsed)


def test_after_redis_restarts_no_request_fails_on_a_dead_pooled_connection(start_gateway):
    # The gateway's pooled connections all die with Redis; each used to fail its
    # next request with a 503 once Redis was back.
    with RedisServer() as server:
        gateway = start_gateway(redis_url=server.url)
        with gateway.http() as client, ThreadPoolExecutor(8) as pool:

            def ready_codes() -> list[int]:  # in parallel: several pooled connections
                return list(pool.map(lambda _: client.get("/readyz").status_code, range(32)))

            assert set(ready_codes()) == {200}
            server.kill()
            server.start()  # same port
            assert ready_codes() == [200] * 32


def test_head_requests_are_answered_as_their_get_without_a_body(start_gateway):
    # FastAPI's GET routes answered HEAD with 405: monitors that probe with HEAD (many
    # do by default) reported a healthy gateway as down.
    gateway = start_gateway()
    with gateway.http() as client:
        for path in ("/healthz", "/readyz", "/metrics", "/v1/models"):
            got, head = client.get(path), client.head(path)
            assert head.status_code == got.status_code == 200, (path, head.status_code)
            assert head.content == b""
            assert head.headers["content-type"] == got.headers["content-type"]
        # POST routes stay POST's: a HEAD there is a wrong method, as a GET is.
        assert client.head("/v1/chat/completions").status_code == 405
