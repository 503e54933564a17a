"""The engine's small HTTP server: /healthz, /readyz and /metrics.

Standard library only, on its own thread: the probes must answer while the
main thread is busy in a long step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
    ) -> None:
        routes = {
            "/healthz": lambda: _probe(live()),
            "/readyz": lambda: _probe(ready()),
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, metrics()),
        }

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
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

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
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


def _probe(result: tuple[bool, str]) -> tuple[int, str, bytes]:
    ok, detail = result
    return (200 if ok else 503), "text/plain", f"{'ok' if ok else 'not ready'}: {detail}\n".encode()
