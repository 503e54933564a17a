"""Latency the gateway adds, against the same requests sent straight through Redis.

    python bench/gateway_overhead.py [--rate 200] [--seconds 5] [--rounds 3]
                                     [--engine tiny|stub|both]

One redis-server, one engine and one `tandem gateway` (--no-auth), each its
own process, as deployed. Two engines, one after the other:

  tiny  a NORMAL `tandem engine` on random:tiny (run below what it sustains:
        its own throughput on shared CPUs is far under 200 requests/s);
  stub  a process speaking the engine's side of the protocol (the real
        WorkQueue and ResponseWriter) that answers every request at once with
        one token: it isolates the gateway's cost at rates a CPU engine
        cannot reach.

The same request (a short text prompt, max_tokens 1, greedy) goes two ways,
in alternating rounds so both see the same machine:

  direct   the Redis protocol from this process: enqueue a WorkItem, read its
           response stream (the gateway's own asyncio reader), no HTTP;
  gateway  POST /v1/completions over HTTP/1.1 keep-alive connections, as many
           as there are requests in flight. A minimal client: httpx spends
           over 5 ms of CPU a request here, and on 2 shared cores the load
           generator, not the gateway, would set the numbers.

Open loop: requests start on a fixed schedule (--rate per second) whether or
not earlier ones finished, so a slow path queues instead of slowing the
offered load. Latency runs from a request's scheduled start to its answer.
Added latency = gateway percentile - direct percentile. Then a closed loop
(--concurrency clients, back to back) gives the sustained rate of each path.
Target: <= 2 ms p50 and <= 10 ms p99 added at 200 requests/s. Everything,
the engine included, shares this machine's cores: read the absolute numbers
with that in mind (the report prints the core count and the engine's share).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis
from counts import count  # bench/ is on sys.path when run as a script

from tandem.gateway.broker import Broker
from tandem.gateway.reader import AsyncResponseReader
from tandem.keys import Keys
from tandem.protocol import EventKind, WorkItem
from tandem.redis_server import RedisServer, free_port

PROMPT = "The gateway adds how much?"
SAMPLING = {"max_tokens": 1, "temperature": 0.0}
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
TARGET_P50_MS, TARGET_P99_MS = 2.0, 10.0

Send = Callable[[], Awaitable[None]]


class HttpClients:
    """Keep-alive HTTP/1.1 connections to one server, one request in flight on each."""

    def __init__(self, host: str, port: int, path: str, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self) -> tuple[int, bytes]:
        for attempt in range(2):  # a kept-alive connection the server closed: a new one
            conn = self._idle.pop() if self._idle and not attempt else await self._open()
            try:
                answer = await self._exchange(*conn)
            except (ConnectionError, asyncio.IncompleteReadError):
                conn[1].close()
                if attempt:
                    raise
                continue
            self._idle.append(conn)
            return answer
        raise AssertionError("unreachable")

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int, bytes]:
        writer.write(self.request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await reader.readexactly(length)

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()


def stub_engine(redis_url: str, prefix: str) -> int:
    """The engine's side of the protocol, answering each request at once (one token)."""
    import redis

    from tandem.engine.service.registry import Registry
    from tandem.engine.service.responses import ResponseWriter
    from tandem.engine.service.work_queue import WorkQueue
    from tandem.protocol import ResponseEvent, Role, Usage
    from tandem.registry_entry import EngineInfo

    client = redis.Redis.from_url(redis_url)
    keys = Keys(prefix)
    queue = WorkQueue(client, keys, "tiny", Role.NORMAL, "stub")
    writer = ResponseWriter(client, keys, "stub")
    registry = Registry(client, keys)
    info = EngineInfo("stub", "tiny", "normal", "127.0.0.1:1")
    beat = 0.0
    while True:
        if time.monotonic() - beat > 2:
            registry.heartbeat(info)
            beat = time.monotonic()
        pulled = queue.pull(256, block_ms=50)
        for delivery in pulled.work:
            rid = delivery.request_id
            writer.add(rid, ResponseEvent.tokens(0, [1], "x", "stub"))
            usage = Usage(delivery.message.estimated_prompt_tokens, 1)
            writer.add(rid, ResponseEvent.finish(1, "length", usage, "stub"))
        writer.flush()
        queue.ack(pulled.work)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_CPU_KERNELS": "0"}
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def wait_http(url: str, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout} s")


async def open_loop(send: Send, rate: float, seconds: float) -> tuple[list[float], float]:
    """Latencies (s) of rate*seconds requests started on schedule, and the wall time."""
    count = int(rate * seconds)
    latencies: list[float] = []
    start_at = time.perf_counter()

    async def one(scheduled: float) -> None:
        await send()
        latencies.append(time.perf_counter() - scheduled)

    tasks = []
    for i in range(count):
        scheduled = start_at + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    return latencies, time.perf_counter() - start_at


async def closed_loop(send: Send, concurrency: int, seconds: float) -> float:
    """Requests per second with `concurrency` clients sending back to back."""
    done = 0
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await send()
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000


async def bench(
    args: argparse.Namespace,
    redis_url: str,
    keys: Keys,
    gateway_url: str,
    pids: dict[str, int],
    *,
    capped: bool,
) -> None:
    """Both paths at args.rate; with `capped`, at most half of what the engine
    sustains (measured first), so the engine's queue stays short and the
    latencies compare the paths, not the backlog."""
    client = aioredis.Redis.from_url(redis_url, max_connections=4096)
    broker = Broker(client, keys)
    reader = AsyncResponseReader(client, keys)
    host, port = gateway_url.removeprefix("http://").split(":")
    http = HttpClients(host, int(port), "/v1/completions", BODY)

    async def direct() -> None:
        rid = uuid.uuid4().hex
        item = WorkItem(
            rid, "tiny", prompt=PROMPT, sampling=SAMPLING, estimated_prompt_tokens=len(PROMPT) // 4
        )
        await broker.enqueue([item])
        async for _, event in reader.events([rid], time.monotonic() + 60):
            if event.event == EventKind.ERROR:
                raise RuntimeError(event.error_message)

    async def gateway() -> None:
        status, body = await http.post()
        if status != 200:
            raise RuntimeError(body.decode(errors="replace"))

    paths = {"direct": direct, "gateway": gateway}
    for send in paths.values():  # warm up: connections, the engine's first steps
        await open_loop(send, min(args.rate, 20), 1.0)
    rate = args.rate
    if capped:
        capacity = await closed_loop(direct, args.concurrency, args.seconds)
        rate = min(args.rate, 0.5 * capacity)
        print(f"  the engine sustains {capacity:.0f} req/s here: open loop at {rate:.0f} req/s")
    latencies: dict[str, list[float]] = {name: [] for name in paths}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    # CPU seconds each process spent during each path's rounds (this client too).
    cpu: dict[str, dict[str, float]] = {
        name: dict.fromkeys([*pids, "client"], 0.0) for name in paths
    }
    for round_ in range(args.rounds):
        for name, send in paths.items():
            before = _cpu_now(pids)
            got, wall = await open_loop(send, rate, args.seconds)
            for process, used in _cpu_now(pids).items():
                cpu[name][process] += used - before[process]
            latencies[name] += got
            rates[name].append(len(got) / wall)
            print(
                f"  round {round_ + 1} {name:8s} p50 {pct(got, 50):7.2f} ms  "
                f"p99 {pct(got, 99):7.2f} ms  ({len(got) / wall:.0f} req/s)",
                flush=True,
            )
    sustained = {
        name: await closed_loop(send, args.concurrency, args.seconds)
        for name, send in paths.items()
    }
    http.close()
    await client.aclose()

    total = sum(map(len, latencies.values()))
    print(
        f"\nopen loop at {rate:.0f} req/s offered, {total} requests, {os.cpu_count()} "
        "cores shared by engine, gateway, redis and this client"
    )
    header = ("path", "p50 ms", "p99 ms", "mean ms", "req/s", "max req/s")
    print(f"{header[0]:10s}" + "".join(f"{h:>10s}" for h in header[1:]))
    for name in paths:
        values = latencies[name]
        print(
            f"{name:10s}{pct(values, 50):10.2f}{pct(values, 99):10.2f}"
            f"{statistics.fmean(values) * 1000:10.2f}{statistics.fmean(rates[name]):10.0f}"
            f"{sustained[name]:10.0f}"
        )
    print("\nCPU per request (ms) during the open-loop rounds of each path:")
    for name in paths:
        count = len(latencies[name])
        shares = "  ".join(f"{p} {cpu[name][p] / count * 1000:5.2f}" for p in cpu[name])
        print(f"  {name:8s} {shares}")
    d, g = latencies["direct"], latencies["gateway"]
    added50, added99 = pct(g, 50) - pct(d, 50), pct(g, 99) - pct(d, 99)
    ok50, ok99 = added50 <= TARGET_P50_MS, added99 <= TARGET_P99_MS
    print(
        f"\nadded by the gateway: p50 {added50:+.2f} ms (target <= {TARGET_P50_MS:g}: "
        f"{'met' if ok50 else 'MISSED'}), p99 {added99:+.2f} ms (target <= {TARGET_P99_MS:g}: "
        f"{'met' if ok99 else 'MISSED'})"
    )
    print(
        f"gateway / direct: p50 x{pct(g, 50) / pct(d, 50):.2f}, p99 x{pct(g, 99) / pct(d, 99):.2f},"
        f" sustained rate x{sustained['gateway'] / sustained['direct']:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="offered requests per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of one round")
    parser.add_argument("--rounds", type=count, default=3)
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop clients")
    parser.add_argument("--engine", choices=["tiny", "stub", "both"], default="both")
    parser.add_argument("--stub-engine", nargs=2, metavar=("REDIS_URL", "PREFIX"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.stub_engine:
        return stub_engine(*args.stub_engine)
    if args.rate <= 0 or args.seconds <= 0 or args.rounds < 1 or args.concurrency < 1:
        parser.error("--rate, --seconds, --rounds and --concurrency must be positive")
    if args.rate * args.seconds < 1:  # an open-loop round of no request measures nothing
        parser.error(
            f"--rate {args.rate:g} x --seconds {args.seconds:g} sends no request in a round: "
            "give at least one (rate x seconds >= 1)"
        )
    kinds = ["stub", "tiny"] if args.engine == "both" else [args.engine]
    for kind in kinds:
        print(f"\n=== engine: {kind} ===", flush=True)
        run(args, kind)
    return 0


def run(args: argparse.Namespace, kind: str) -> None:
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    keys = Keys(f"bench{uuid.uuid4().hex[:6]}")
    with RedisServer() as server:
        engine_port, gateway_port = free_port(), free_port()
        tandem = [sys.executable, "-m", "tandem.cli"]
        common = ["--redis-url", server.url, "--key-prefix", keys.prefix, "--host", "127.0.0.1"]
        if kind == "stub":
            engine_cmd = [sys.executable, __file__, "--stub-engine", server.url, keys.prefix]
        else:
            engine_cmd = [
                *tandem, "engine", "--model", "random:tiny", "--served-model-name", "tiny",
                "--port", str(engine_port), "--kv-port", str(free_port()),
                "--max-model-len", "256", "--num-kv-blocks", "512", "--max-waiting", "64",
                *common,
            ]  # fmt: skip
        engine = start(engine_cmd, logs / f"bench-engine-{kind}.log")
        gateway = start(
            [*tandem, "gateway", "--no-auth", "--port", str(gateway_port), "--max-queue",
             "100000", *common],
            logs / "bench-gateway.log",
        )  # fmt: skip
        try:
            if kind == "tiny":
                url = f"http://127.0.0.1:{engine_port}/readyz"
                wait_http(url, engine, logs / f"bench-engine-{kind}.log")
            gateway_url = f"http://127.0.0.1:{gateway_port}"
            wait_http(f"{gateway_url}/readyz", gateway, logs / "bench-gateway.log")
            load = os.getloadavg()[0]
            pids = {"engine": engine.pid, "gateway": gateway.pid}
            asyncio.run(bench(args, server.url, keys, gateway_url, pids, capped=kind == "tiny"))
            after, cores = os.getloadavg()[0], os.cpu_count() or 1
            busy = max(load, after) > cores
            print(
                f"load average (1 min) {load:.1f} before, {after:.1f} after, on {cores} cores"
                + (": above the core count, other work shared the machine" if busy else "")
            )
        finally:
            for process in (gateway, engine):
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


def _cpu_now(pids: dict[str, int]) -> dict[str, float]:
    return {
        **{name: _cpu_seconds(pid) for name, pid in pids.items()},
        "client": time.process_time(),
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), 0 where unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


if __name__ == "__main__":
    sys.exit(main())
