"""HEAD requests answered as their GET, without the body (RFC 9110 asks a server for
both): FastAPI's GET routes answer HEAD with 405, and uptime monitors and load
balancers that probe with HEAD then report a healthy gateway as down."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGet:
    """Pure ASGI: the app sees a GET; the client gets its status and headers alone
    (Content-Length the GET's, as HEAD's is meant to be)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                more = message.get("more_body", False)
                message = {"type": "http.response.body", "body": b"", "more_body": more}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
