"""The engine's probe server: a prober that hangs up is no error in the engine's log."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import pytest
from support.ipv6 import ipv6_loopback

from tandem.engine.service.http import HealthServer


def test_a_prober_that_gives_up_leaves_no_traceback(capfd):
    answered = threading.Event()

    def slow_metrics() -> bytes:  # a scrape arriving during a long step
        time.sleep(0.3)
        answered.set()
        return b"x" * 1_000_000

    server = HealthServer(
        "127.0.0.1", 0, live=lambda: (True, ""), ready=lambda: (True, ""), metrics=slow_metrics
    ).start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        # Hang up with a reset, as a client whose timeout ran out does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        assert answered.wait(5)
        time.sleep(0.3)  # the handler's write fails now
        with socket.create_connection(("127.0.0.1", server.port)) as again:
            again.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert again.recv(64).startswith(b"HTTP/1.0 200")
    finally:
        server.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


def _server(**bounds: float) -> HealthServer:
    ok = lambda: (True, "")  # noqa: E731
    return HealthServer("127.0.0.1", 0, live=ok, ready=ok, metrics=lambda: b"", **bounds).start()


def _half_sent(server: HealthServer) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    conn.sendall(b"GET /healthz HTTP/1.1\r\n")  # and never the blank line
    return conn


def test_a_client_that_never_finishes_its_request_is_dropped():
    # Each held a thread for as long as it stayed connected.
    server = _server(idle_s=0.3)
    try:
        with _half_sent(server) as conn:
            assert conn.recv(64) == b""  # closed after the idle time, within recv's 5 s
    finally:
        server.stop()


def test_past_its_connections_at_once_a_new_one_cuts_the_oldest_still_sending():
    # Clients trickling a byte every few seconds took every slot: the probes were
    # refused, and the engine was killed as dead (by tandem up, by the kubelet).
    server = _server(most_at_once=2)
    try:
        held = [_half_sent(server) for _ in range(2)]
        time.sleep(0.1)  # both taken in, the first the older
        for _ in range(3):  # each probe cuts the oldest one still sending
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as probe:
                probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert probe.recv(64).startswith(b"HTTP/1.0 200")
        assert held[0].recv(64) == b""  # cut
        for conn in held:
            conn.close()
    finally:
        server.stop()


def test_a_trickling_crowd_does_not_keep_the_probes_out():
    server = _server(most_at_once=8)
    crowd = []
    try:
        for _ in range(20):  # more than the slots, each sending a byte now and then
            conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            conn.sendall(b"G")
            crowd.append(conn)
        for _ in range(3):
            for conn in crowd:
                with contextlib.suppress(OSError):
                    conn.sendall(b"E")
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as probe:
                probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert probe.recv(64).startswith(b"HTTP/1.0 200")
    finally:
        for conn in crowd:
            conn.close()
        server.stop()


@pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
def test_it_listens_on_an_ipv6_address():
    # `--host ::` on an IPv6 cluster (the KV server took it; this server failed at start).
    ok = lambda: (True, "")  # noqa: E731
    server = HealthServer("::1", 0, live=ok, ready=ok, metrics=lambda: b"").start()
    try:
        with socket.create_connection(("::1", server.port), timeout=5) as conn:
            conn.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert conn.recv(64).startswith(b"HTTP/1.0 200")
    finally:
        server.stop()


@pytest.mark.skipif(not ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
def test_an_engine_in_a_pod_of_an_ipv6_cluster_listens_on_ipv6(engines, monkeypatch):
    # --host 0.0.0.0 (the operator's) listened on IPv4 alone: a pod with an IPv6 address
    # only was refused its probes, and restarted as dead.
    monkeypatch.setenv("POD_IP", "fd00::7")
    engine = engines("normal", "--host", "0.0.0.0")
    with socket.create_connection(("::1", engine.port), timeout=5) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.recv(64).startswith(b"HTTP/1.0 200")
