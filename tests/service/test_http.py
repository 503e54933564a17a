"""The engine's probe server: a prober that hangs up is no error in the engine's log."""

from __future__ import annotations

import socket
import struct
import threading
import time

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
