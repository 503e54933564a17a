"""Requests whose target is in absolute form (`GET http://host/v1/models HTTP/1.1`, as
clients behind a forward proxy send it), which RFC 9112 (3.2.2) says a server must
accept. The server hands that target over as the path: routed as given, each such
request was a 404 "Invalid URL (GET http://host/v1/models)"."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send


class AbsoluteForm:
    """Pure ASGI: the app sees the target's path (origin form) and its query."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith("/"):
            scope = origin_form(scope)
        await self.app(scope, receive, send)


def origin_form(scope: Scope) -> Scope:
    """The scope of an http(s) URL target as its origin form; any other left as it is.
    Split as sent (raw_path), then decoded: split after decoding, a path's %3F or %23
    cut it short (`http://h/v1/models%3Fx` was served as /v1/models)."""
    raw = scope.get("raw_path")
    target = urlsplit(raw.decode("latin-1") if raw else scope["path"])
    if target.scheme.lower() not in ("http", "https") or not target.netloc:
        return scope
    raw_path = target.path or "/"
    path = unquote(raw_path) if raw else raw_path
    return {**scope, "path": path, "raw_path": raw_path.encode("latin-1")}
