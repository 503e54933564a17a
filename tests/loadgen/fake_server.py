"""An OpenAI-style streaming server in an httpx.MockTransport: no sockets, controllable timing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@dataclass
class FakeServer:
    # Seconds before the first token, and between tokens.
    first_delay: float = 0.0
    token_delay: float = 0.0
    # Send the usage chunk (stream_options.include_usage).
    usage: bool = True
    # Requests being answered now, and the most at once.
    in_flight: int = 0
    peak: int = 0
    # Bodies received, in arrival order.
    bodies: list[dict] = field(default_factory=list)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # /v1/models lists one model; nothing else is served
            if request.url.path.endswith("/models"):
                return httpx.Response(200, json={"object": "list", "data": [{"id": "fake"}]})
            return httpx.Response(404)
        body = json.loads(request.content)
        self.bodies.append(body)
        return httpx.Response(
            200, content=self._stream(body), headers={"content-type": "text/event-stream"}
        )

    async def _stream(self, body):
        # Counted until the last chunk is produced: a client stops reading at
        # [DONE], and the generator may only be closed later.
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        chat = "messages" in body
        if chat:
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(self.first_delay)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await asyncio.sleep(self.token_delay)
            choice = {"index": 0, "delta": {"content": "x"}} if chat else {"text": "x"}
            yield sse({"choices": [{**choice, "finish_reason": None}]})
        done = {"index": 0, "finish_reason": "length"}
        done |= {"delta": {}} if chat else {"text": ""}
        chunks = [sse({"choices": [done]})]
        if self.usage:
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
            chunks.append(sse({"choices": [], "usage": usage}))
        self.in_flight -= 1
        yield b"".join([*chunks, b"data: [DONE]\n\n"])
