"""The engine's small HTTP server: /healthz, /readyz and /metrics.

Standard library only, on its own thread: the probes must answer while the
main thread is busy in a long step.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST


class HealthServer:
    """Serves the probes from callbacks: live() and ready() return (ok, detail)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        live: Callable[[], tuple[bool, str]],
        ready: Callable[[], tuple[bool, str]],
        metrics: Callable[[], bytes],
        idle_s: float = 10.0,
        most_at_once: int = 128,
    ) -> None:
        routes = {
            "/healthz": lambda: _probe(live()),
            "/readyz": lambda: _probe(ready()),
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics()),
        }

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_s  # a client silent this long between reads is dropped

            def do_GET(self) -> None:
                self.server.request_read(self.connection)  # type: ignore[attr-defined]
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    status, ctype, body = 404, "text/plain", b"not found\n"
                else:
                    try:
                        status, ctype, body = route()
                    except Exception as exc:  # a probe must answer, never hang
                        status, ctype, body = 500, "text/plain", f"{exc}\n".encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the prober gave up waiting (a long step): nobody to answer

            def log_message(self, *args: object) -> None:  # probes every few seconds: quiet
                pass

        self._server = _BoundedServer((host, port), Handler, most_at_once)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="engine-http", daemon=True
        )

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _BoundedServer(ThreadingHTTPServer):
    """Probes and scrapes are a few small requests at a time: at most `most` connections
    are served at once (half-sent requests held a thread each, 500 of them 509
    threads; the KV transfers need threads too). A connection past them cuts the oldest
    one still sending its request: clients trickling a byte every few seconds took
    every slot and the probes were refused until the engine was killed as dead."""

    daemon_threads = True
    request_queue_size = 64  # the standard library's 5 dropped probes in a burst

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], most: int
    ) -> None:
        # --host :: or an IPv6 address (an IPv6 cluster): the standard library binds
        # IPv4 only, and the engine failed at start on the address it was given.
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(most)
        self._lock = threading.Lock()
        # Connections still reading their request -> when they were accepted.
        self._reading: dict[Any, float] = {}

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._cut_oldest_reader()
            if not self._slots.acquire(timeout=1.0):  # its thread leaves at the cut
                self.shutdown_request(request)  # every slot answering: a prober retries
                return
        with self._lock:
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def request_read(self, request: Any) -> None:
        """The connection's request is in: it is answered now, never cut."""
        with self._lock:
            self._reading.pop(request, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._lock:
            self._reading.pop(request, None)
        self._slots.release()

    def _cut_oldest_reader(self) -> None:
        with self._lock:
            if not self._reading:
                return
            oldest = min(self._reading, key=self._reading.__getitem__)
            del self._reading[oldest]
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its read returns: its thread ends


def _probe(result: tuple[bool, str]) -> tuple[int, str, bytes]:
    ok, detail = result
    return (200 if ok else 503), "text/plain", f"{'ok' if ok else 'not ready'}: {detail}\n".encode()
