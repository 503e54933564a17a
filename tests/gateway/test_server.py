"""The HTTP server: a connection that does not send a request's headers in time is
closed (idle ones held descriptors for ever), and asyncio's accept errors are thinned."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import time

from support.polling import eventually

from tandem.gateway.server import OncePer, graceful_seconds

from .live import API_KEY


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (reads b""), or None if it did not."""
    sock.settimeout(seconds)
    started = time.monotonic()
    try:
        while sock.recv(4096):
            pass  # a response, then the close
    except TimeoutError:
        return None
    return time.monotonic() - started


def test_connections_slow_to_send_their_headers_are_closed(start_gateway):
    gateway = start_gateway(header_timeout_s=0.5)
    port = int(gateway.url.rsplit(":", 1)[1])
    silent = socket.create_connection(("127.0.0.1", port))
    trickle = socket.create_connection(("127.0.0.1", port))
    trickle.sendall(b"GET /healthz HTTP/1.1\r\n")  # and nothing more: a slowloris
    for sock in (silent, trickle):
        took = _closed_within(sock, 5)
        assert took is not None and took < 2, took
        sock.close()
    # A request whose headers came in time is answered, and its connection kept for
    # the next one (then the same deadline for that one's headers).
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    for _ in range(2):
        kept.request("GET", "/healthz")
        assert kept.getresponse().read() == b'{"status":"ok"}'
        time.sleep(0.3)
    assert kept.sock is not None and _closed_within(kept.sock, 5) is not None
    kept.close()
    with gateway.http() as client:  # and the gateway serves on
        assert client.get("/healthz").status_code == 200


def test_a_body_left_unread_after_the_answer_does_not_hold_the_connection(start_gateway):
    # A GET (or a 404, a 405) with a body it does not read: one byte of it after the
    # answer held the connection for ever, no key needed, past every deadline.
    gateway = start_gateway(header_timeout_s=0.5)
    port = int(gateway.url.rsplit(":", 1)[1])
    for method, path in (("GET", "/healthz"), ("GET", "/nothing-here"), ("DELETE", "/v1/models")):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
            sock.sendall(head.encode())
            time.sleep(0.2)  # answered meanwhile
            with contextlib.suppress(OSError):
                sock.sendall(b"a")
            took = _closed_within(sock, 5)
            assert took is not None and took < 2, (method, path, took)
    # One whose body comes whole after the answer keeps its connection for the next.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        assert _healthz_answer(sock)
        sock.sendall(b"null" + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _healthz_answer(sock)


def test_a_target_in_absolute_form_is_served_as_its_path(start_gateway):
    # As clients behind a forward proxy send it, and RFC 9112 says a server must accept:
    # each was a 404 "Invalid URL (GET http://host/v1/models)".
    gateway = start_gateway()
    port = int(gateway.url.rsplit(":", 1)[1])
    authorized = {"Authorization": f"Bearer {API_KEY}"}
    for target in (f"http://127.0.0.1:{port}/v1/models", "HTTPS://gw.example/v1/models?x=1"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", target, headers=authorized)
        answer = conn.getresponse()
        assert answer.status == 200, (target, answer.read())
        assert json.loads(answer.read())["object"] == "list"
        conn.close()
    # Counted by their route (just after their last byte went out).
    route = {"route": "/v1/models"}
    assert eventually(lambda: gateway.metric("tandem_gateway_requests_total", **route) == 2)
    # Split as sent, then decoded: an encoded "?" is part of the path (not served here).
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "http://gw.example/v1/models%3Fx", headers=authorized)
    assert conn.getresponse().status == 404
    conn.close()
    # Another scheme is no URL of this server's.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "ftp://gw.example/healthz")
    assert conn.getresponse().status == 404
    conn.close()


def _healthz_answer(sock: socket.socket) -> bytes:
    """The bytes of one /healthz answer read from `sock`, or b"" if it was closed first."""
    got = b""
    while b'{"status":"ok"}' not in got:
        more = sock.recv(4096)
        if not more:
            return b""
        got += more
    return got


def test_a_slow_body_is_the_body_timeouts_not_the_headers(start_gateway):
    # The header deadline ends with the headers: a body on its way is timed by
    # body_timeout_s (408), not cut at the header deadline.
    gateway = start_gateway(header_timeout_s=0.3, body_timeout_s=5)
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer sk-tandem-test\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\n\r\n"
        )
        sock.sendall(head + b"{")
        time.sleep(1.0)  # past the header deadline, within the body's
        sock.sendall(b"}")
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")  # read whole: {} lacks a model


def test_accept_errors_are_logged_once_per_interval():
    records = []
    once = OncePer(("socket.accept() out of system",), seconds=60)
    for message in ["socket.accept() out of system resource\nsocket: ...", "other"] * 3:
        record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)
        if once.filter(record):
            records.append(message.split("\n")[0])
    assert records == ["socket.accept() out of system resource", "other", "other", "other"]


def test_the_shutdown_timeout_is_never_cut_short():
    # int() gave requests 2 s of a --shutdown-timeout of 2.9.
    assert [graceful_seconds(t) for t in (0.1, 1, 2.9, 30)] == [1, 1, 3, 30]
