"""engine_metrics.scrape against servers that are not a healthy engine: none
listening, one that never answers, one that answers a few bytes at a time."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from tandem.engine.service.metrics import EngineMetrics
from tandem.operator.engine_metrics import scrape

pytestmark = pytest.mark.asyncio


async def test_an_unreachable_pod_is_none():
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with httpx.AsyncClient() as client:
        assert await scrape(client, f"http://127.0.0.1:{port}", "p0") is None


async def test_a_slow_pod_is_none_after_the_timeout():
    # A listening socket nobody accepts from: the kernel completes the handshake,
    # the request goes out, no answer ever comes (a pod stuck in a long GC, say).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        started = time.monotonic()
        async with httpx.AsyncClient() as client:
            assert await scrape(client, url, "p0", timeout=0.2) is None
        # Without the timeout: never. The slack is for a loaded machine (tests run in parallel).
        assert time.monotonic() - started < 2.0


class Trickle:
    """A server answering one path in 100 pieces 50 ms apart (5 s): each read is quick,
    the whole answer is not."""

    def __init__(self, slow_path: str) -> None:
        self.slow_path, self.page = slow_path, EngineMetrics("tiny", "normal").render()
        self.handlers: set[asyncio.Task] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        path = (await reader.readuntil(b"\r\n\r\n")).split()[1].decode()
        body = self.page if path == "/metrics" else b"ok " * 30
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        chunks = 100 if path == self.slow_path else 1
        for i in range(chunks):
            if reader.at_eof():
                break  # the scraper hung up
            writer.write(body[i * len(body) // chunks : (i + 1) * len(body) // chunks])
            await asyncio.sleep(0.05 if chunks > 1 else 0)
        writer.close()


@pytest.mark.parametrize("slow_path", ["/metrics", "/readyz"])
async def test_a_trickling_pod_is_cut_off_at_the_timeout(slow_path):
    # --scrape-timeout is what one engine's scrape may take, not each read of it.
    trickle = Trickle(slow_path)
    async with await asyncio.start_server(trickle.handle, "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with httpx.AsyncClient() as client:
            started = time.monotonic()
            s = await scrape(client, url, "p0", timeout=0.3)
            elapsed = time.monotonic() - started
        await asyncio.gather(*trickle.handlers)
    assert elapsed < 3.0  # cut at 0.3 s; the trickle would take 5 s
    if slow_path == "/metrics":
        assert s is None  # unreadable, as a pod that is down
    else:
        assert s is not None and not s.ready  # a readiness probe that does not answer


async def test_a_page_past_the_size_limit_is_unreadable_not_read_whole():
    # A pod runs its spec's image: gigabytes of /metrics must not take the operator's
    # memory (and every model's autoscaling with it).
    sent = []

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
        chunk = b"# " + b"x" * 65533 + b"\n"
        try:
            for _ in range(1 << 14):  # 1 GiB, if the scraper kept reading
                writer.write(chunk)
                await writer.drain()
                sent.append(len(chunk))
        except ConnectionError:
            pass  # the scraper hung up
        writer.close()

    async with await asyncio.start_server(flood, "127.0.0.1", 0) as server:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with httpx.AsyncClient() as client:
            assert await scrape(client, url, "p0", timeout=5.0) is None
    assert sum(sent) < 64 << 20
