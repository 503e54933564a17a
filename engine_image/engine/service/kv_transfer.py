"""KV handoff: a PROMPT engine serves a prefilled request's KV, a COMPLETION engine fetches it.

The PROMPT engine runs a KVServer beside its step loop; the Handoff names its address,
the handle and the fingerprint. The COMPLETION engine reserves blocks, runs fetch_kv()
off its main thread, and marks the request decodable only once fetch_kv returned: a
failed fetch raises KVTransferError and leaves nothing usable, so the caller counts
the reason and recomputes the prompt. KVTransport is the seam for an RDMA transport
(NIXL, Mooncake); TCP is the one here.

TCP wire format, version WIRE_VERSION (control messages in JSON, KV as raw bytes):
    message = magic b"TKVM", u32 length, a JSON object of that length
    client -> {"v", "op": "fetch", "handle", "fingerprint", "num_tokens", "layout"}
    server -> {"v", "ok": true, "layout", "num_tokens", "frame_tokens", "byteorder"}
              or {"v", "ok": false, "reason", "error"}, and it closes
    server -> frames, layer by layer, frame_tokens tokens each (the last fewer):
              u32 layer, u32 first token, u32 tokens, u64 xxh3 hash of the payload, then the
              payload: K then V rows of those tokens, [2, tokens, kv_heads, head_dim]
    server -> {"v", "ok": true}: the rows were still pinned when read
    client -> {"v", "op": "ack", "handle"}: only now may the server free the KV
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import torch
import xxhash

log = logging.getLogger(__name__)

WIRE_VERSION = 2  # 2: 64-bit xxh3 frame checksums (1 had crc32)
_MAGIC = b"TKVM"
_MSG_HEADER = struct.Struct("!4sI")
_FRAME_HEADER = struct.Struct("!IIIQ")  # layer, first token, tokens, xxh3-64 of the payload
_MAX_MESSAGE = 64 << 10
# Large enough that per-frame Python costs vanish, small enough that gather, checksum
# and send work on cache-warm data and overlap; a client refuses frames over the max.
DEFAULT_FRAME_BYTES = 1 << 20
_MAX_FRAME_BYTES = 256 << 20
_BUFFERS = 3  # per transfer: one being filled, one being drained, one spare
# Links need more than the default window to stay busy; Linux caps it at rmem/wmem_max.
_SOCKET_BUFFER = 4 << 20

Lookup = Callable[[str], "PinnedKV | None"]
OnFetched = Callable[[str], None]


class Reason(StrEnum):
    """Why a fetch failed; a StrEnum, so `error.reason == "timeout"` holds."""

    UNREACHABLE = "unreachable"  # could not connect, or the connection dropped
    REFUSED = "refused"  # the server does not (or no longer) hold the handle
    MISMATCH = "mismatch"  # fingerprint, token count or layout differ
    CHECKSUM = "checksum"  # a frame arrived corrupted
    TIMEOUT = "timeout"  # the deadline passed
    PROTOCOL = "protocol"  # the peer spoke something else (version, framing)


class KVTransferError(Exception):
    """A fetch failed; `reason` (a Reason) is for counting failures by cause."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"KV transfer failed ({reason}): {message}")
        self.reason = Reason(reason)
        self.detail = message


@dataclass(frozen=True)
class KVLayout:
    """What a KV cache holds per token; both ends must agree on it exactly."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {self!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> KVLayout:
        """The layout of per-layer kv[2, blocks, block_size, kv_heads, head_dim] caches."""
        if not kv_caches or kv_caches[0].dim() != 5:
            raise ValueError("expected per-layer kv[2, blocks, block_size, heads, dim] caches")
        first = kv_caches[0]
        layout = cls(len(kv_caches), first.shape[3], first.shape[4], first.dtype)
        layout.check_caches(kv_caches)
        return layout

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.layer_token_bytes

    def to_dict(self) -> dict[str, Any]:
        dtype = str(self.dtype).removeprefix("torch.")
        return {
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": dtype,
        }

    def check_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """ValueError unless kv_caches are contiguous per-layer caches of this layout."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for a {self.num_layers}-layer layout")
        want = (2, self.num_kv_heads, self.head_dim, self.dtype, True)
        for i, cache in enumerate(kv_caches):
            if (cache.shape[0], *cache.shape[3:], cache.dtype, cache.is_contiguous()) != want:
                raise ValueError(
                    f"KV cache of layer {i} is a {cache.dtype} {tuple(cache.shape)} tensor; "
                    f"the layout needs contiguous {self.dtype} [2, blocks, block_size, "
                    f"{self.num_kv_heads}, {self.head_dim}]"
                )


@dataclass(frozen=True)
class PinnedKV:
    """A prefilled request's KV as the PROMPT engine keeps it for a fetch."""

    handle: str
    slots: torch.Tensor  # long [num_tokens]: flat cache slot of each position, in order
    fingerprint: str


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float
    layers: int


class KVEndpoint(Protocol):
    """A transport's serving half: start() returns the address to advertise."""

    def start(self) -> str: ...

    def stop(self) -> None: ...


class KVTransport(Protocol):
    """The two halves of a KV handoff; another transport (RDMA) implements both.

    serve: expose the PROMPT engine's caches. lookup(handle) runs on transport threads
    and returns the pinned KV or None (unknown or expired); it must be thread-safe, and
    the engine must drop a handle from it *before* freeing the handle's blocks.
    on_fetched(handle) runs on a transport thread once the fetcher confirmed that all
    the KV arrived; it may come twice for a handle fetched twice.

    fetch: copy the KV of `handle` into dest_slots of the local caches within `timeout`
    seconds, or raise KVTransferError, after which the rows at dest_slots are garbage.
    """

    def serve(
        self, kv_caches: list[torch.Tensor], layout: KVLayout, lookup: Lookup, on_fetched: OnFetched
    ) -> KVEndpoint: ...

    def fetch(
        self,
        address: str,
        handle: str,
        fingerprint: str,
        num_tokens: int,
        dest_slots: torch.Tensor,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        timeout: float,
    ) -> TransferStats: ...


class KVServer:
    """Serves the pinned KV in this engine's caches to fetchers, a bounded pool at a time.

    Transfers only read rows of pinned requests, which the engine's main thread leaves
    alone while it steps on other blocks; they reach it only through lookup and
    on_fetched (see KVTransport).
    """

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        lookup: Lookup,
        on_fetched: OnFetched,
        host: str = "0.0.0.0",
        advertise_host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = 4,
        io_timeout: float = 30.0,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
    ) -> None:
        layout.check_caches(kv_caches)
        if max_connections < 1 or io_timeout <= 0 or frame_bytes < 1:
            raise ValueError(
                f"KVServer needs max_connections >= 1, io_timeout > 0 and frame_bytes >= 1, "
                f"got {max_connections}, {io_timeout}, {frame_bytes}"
            )
        self._caches, self._layout = kv_caches, layout
        self._lookup, self._on_fetched = lookup, on_fetched
        self._bind, self._advertise_host = (host, port), advertise_host
        self._max_connections, self._io_timeout = max_connections, io_timeout
        self._frame_tokens = max(1, frame_bytes // layout.layer_token_bytes)
        self._listener: socket.socket | None = None
        self._threads: tuple[threading.Thread, ThreadPoolExecutor] | None = None
        self._open: set[socket.socket] = set()  # accepted, not closed: stop() cuts them
        self._lock = threading.Lock()
        self.address = ""

    def start(self) -> str:
        """Listen; returns the address to advertise, "host:port"."""
        if self._listener is not None:
            raise ValueError(f"the KV server already listens on {self.address}")
        host, port = self._bind
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=64)
        port, name = self._listener.getsockname()[1], self._advertise_host
        self.address = f"[{name}]:{port}" if ":" in name else f"{name}:{port}"
        # Connections beyond the pool wait in its queue, their fetchers' deadlines running.
        workers = ThreadPoolExecutor(self._max_connections, "kv-serve", _one_intra_op_thread)
        acceptor = threading.Thread(
            target=self._accept, args=(self._listener, workers), name="kv-accept", daemon=True
        )
        acceptor.start()
        self._threads = acceptor, workers
        return self.address

    def stop(self) -> None:
        """Stop listening, cut open transfers (their fetchers recompute), wait for them."""
        listener, self._listener = self._listener, None
        if listener is None or self._threads is None:
            return
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux; close() does not
        listener.close()
        acceptor, workers = self._threads
        acceptor.join()
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        workers.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # connections whose turn never came
            for conn in self._open:
                conn.close()
            self._open.clear()

    def _accept(self, listener: socket.socket, workers: ThreadPoolExecutor) -> None:
        while True:
            try:
                conn, peer = listener.accept()
            except OSError:
                return  # stop() closed the listener
            _tune(conn)
            conn.settimeout(self._io_timeout)
            with self._lock:
                self._open.add(conn)
            workers.submit(self._serve, conn, peer)

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            self._serve_fetch(conn, peer)
        except (OSError, _WireError) as exc:
            log.info("KV fetch from %s ended early: %s", peer, exc)
        except Exception:  # a bug: log it; the fetcher sees a dropped connection
            log.exception("KV fetch from %s failed", peer)
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _serve_fetch(self, conn: socket.socket, peer: Any) -> None:
        pinned, refusal = self._admit(_recv_msg(conn, None))
        if pinned is None:
            log.info("KV fetch from %s refused: %s", peer, refusal["error"])
            _send_msg(conn, {"ok": False, **refusal}, None)
            return
        layout, num_tokens, frame_tokens = self._layout, pinned.slots.numel(), self._frame_tokens
        reply = {"ok": True, "layout": layout.to_dict(), "num_tokens": num_tokens}
        _send_msg(conn, {**reply, "frame_tokens": frame_tokens, "byteorder": sys.byteorder}, None)
        frames = _Frames(self._caches, pinned.slots, layout, frame_tokens)
        _pipeline(frames, frames.pack, lambda frame, buf: conn.sendall(frames.wire(frame, buf)))
        # The rows were read while pinned only if the handle is still there: the engine
        # drops it from lookup before it frees (and reuses) its blocks.
        again = self._lookup(pinned.handle)
        if again is None or not torch.equal(again.slots, pinned.slots):
            error = f"the KV of handle {pinned.handle!r} was released during the transfer"
            _send_msg(conn, {"ok": False, "reason": Reason.REFUSED, "error": error}, None)
            return
        _send_msg(conn, {"ok": True}, None)
        ack = _recv_msg(conn, None)
        if ack.get("op") != "ack" or ack.get("handle") != pinned.handle:
            raise _WireError(f"expected an ack for {pinned.handle!r}, got {ack!r:.200}")
        try:
            self._on_fetched(pinned.handle)
        except Exception:
            log.exception("on_fetched(%r) failed", pinned.handle)

    def _admit(self, request: dict[str, Any]) -> tuple[PinnedKV | None, dict[str, str]]:
        """The pinned KV a request may fetch, or None and why not (reason, error)."""
        handle, want = request.get("handle"), self._layout.to_dict()
        pinned = self._lookup(handle) if isinstance(handle, str) else None
        if request.get("v") != WIRE_VERSION or request.get("op") != "fetch":
            why = Reason.PROTOCOL, f"expected a wire version {WIRE_VERSION} fetch: {request!r:.200}"
        elif request.get("layout") != want:
            why = Reason.MISMATCH, f"KV layout {request.get('layout')!r:.200}, server's {want}"
        elif pinned is None:
            why = Reason.REFUSED, f"handle {handle!r:.100} is unknown or expired"
        elif request.get("fingerprint") != pinned.fingerprint:
            why = Reason.MISMATCH, f"the fingerprint does not match handle {handle!r}'s"
        elif request.get("num_tokens") != pinned.slots.numel():
            count = f"{request.get('num_tokens')!r:.20}"
            why = (
                Reason.MISMATCH,
                f"{count} tokens asked, handle {handle!r} has {pinned.slots.numel()}",
            )
        else:
            return pinned, {}
        return None, {"reason": why[0], "error": why[1]}


def fetch_kv(
    address: str,
    handle: str,
    fingerprint: str,
    num_tokens: int,
    dest_slots: torch.Tensor,
    kv_caches: list[torch.Tensor],
    layout: KVLayout,
    timeout: float,
) -> TransferStats:
    """Copy the KV of `handle` from the KV server at `address` into dest_slots.

    dest_slots: long [num_tokens], the flat cache slots (position order) of the blocks
    reserved for the request. `timeout` bounds the whole fetch. Raises KVTransferError
    on any failure, after which those rows are garbage; ValueError for bad arguments.
    """
    layout.check_caches(kv_caches)
    num_slots = kv_caches[0].shape[1] * kv_caches[0].shape[2]
    host, _, port = address.rpartition(":")
    if not isinstance(num_tokens, int) or num_tokens < 1 or not timeout > 0:
        raise ValueError(f"need num_tokens >= 1 and timeout > 0, got {num_tokens!r}, {timeout!r}")
    if not isinstance(dest_slots, torch.Tensor) or dest_slots.dtype != torch.long:
        raise ValueError(f"dest_slots must be a long tensor, got {dest_slots!r:.100}")
    if dest_slots.shape != (num_tokens,):
        raise ValueError(f"dest_slots has shape {tuple(dest_slots.shape)}, not ({num_tokens},)")
    if int(dest_slots.min()) < 0 or int(dest_slots.max()) >= num_slots:
        raise ValueError(f"dest_slots has slots outside the caches' 0..{num_slots - 1}")
    if not host or not port.isdigit():
        raise ValueError(f"KV address must be host:port, got {address!r}")
    start, deadline = time.perf_counter(), time.monotonic() + timeout
    request = {"op": "fetch", "handle": handle, "fingerprint": fingerprint}
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout) as sock:
            _tune(sock)
            _send_msg(
                sock, {**request, "num_tokens": num_tokens, "layout": layout.to_dict()}, deadline
            )
            frame_tokens = _check_reply(_recv_msg(sock, deadline), num_tokens, layout)
            frames = _Frames(kv_caches, dest_slots, layout, frame_tokens)

            def receive(frame: _Frame, buf: _Buffer) -> None:
                _recv_exact(sock, frames.wire(frame, buf), deadline)

            _pipeline(frames, receive, frames.unpack)
            if not (trailer := _recv_msg(sock, deadline)).get("ok"):
                _raise_refusal(trailer)
            # The KV is complete and was pinned while read: a lost ack only leaves the
            # server to free it at expiry, no reason to recompute.
            with contextlib.suppress(OSError):
                _send_msg(sock, {"op": "ack", "handle": handle}, deadline)
    except KVTransferError as exc:
        raise KVTransferError(exc.reason, f"{address}, handle {handle!r}: {exc.detail}") from None
    except TimeoutError as exc:
        raise KVTransferError(Reason.TIMEOUT, f"{address} did not finish in {timeout} s") from exc
    except _WireError as exc:
        raise KVTransferError(Reason.PROTOCOL, f"{address}: {exc}") from exc
    except OSError as exc:
        raise KVTransferError(Reason.UNREACHABLE, f"{address}: {exc}") from exc
    seconds = time.perf_counter() - start
    return TransferStats(num_tokens * layout.bytes_per_token, seconds, layout.num_layers)


@dataclass(frozen=True)
class TCPTransport:
    """KVTransport over TCP: KVServer and fetch_kv."""

    host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"
    port: int = 0

    def serve(
        self, kv_caches: list[torch.Tensor], layout: KVLayout, lookup: Lookup, on_fetched: OnFetched
    ) -> KVServer:
        host, advertise = self.host, self.advertise_host
        return KVServer(kv_caches, layout, lookup, on_fetched, host, advertise, self.port)

    fetch = staticmethod(fetch_kv)


def _check_reply(reply: dict[str, Any], num_tokens: int, layout: KVLayout) -> int:
    """The server's frame size in tokens, once its reply is what this fetch expects."""
    if reply.get("v") != WIRE_VERSION:
        raise _WireError(f"server speaks wire version {reply.get('v')!r}, not {WIRE_VERSION}")
    if not reply.get("ok"):
        _raise_refusal(reply)
    theirs = (reply.get("layout"), reply.get("byteorder"), reply.get("num_tokens"))
    if theirs != (layout.to_dict(), sys.byteorder, num_tokens):
        raise KVTransferError(
            Reason.MISMATCH,
            f"server offers (layout, byte order, tokens) {theirs!r:.300}, this side "
            f"expects {(layout.to_dict(), sys.byteorder, num_tokens)}",
        )
    frame_tokens = reply.get("frame_tokens")
    if not isinstance(frame_tokens, int) or not (
        0 < frame_tokens * layout.layer_token_bytes <= _MAX_FRAME_BYTES
    ):
        raise _WireError(f"bad frame size {frame_tokens!r:.20} tokens")
    return frame_tokens


def _raise_refusal(reply: dict[str, Any]) -> None:
    reason = reply.get("reason")
    reason = reason if reason in tuple(Reason) else Reason.PROTOCOL
    raise KVTransferError(reason, f"server refused: {reply.get('error', reply)!s:.500}")


# ------------------------------------------------------------------- frames

_Frame = tuple[int, int, int, int]  # layer, first token, tokens, payload bytes
_Buffer = tuple[torch.Tensor, memoryview]  # one frame's header + payload, two views


class _Frames:
    """One transfer's frames, layer by layer, and the few buffers they pass through."""

    def __init__(
        self, caches: list[torch.Tensor], slots: torch.Tensor, layout: KVLayout, step: int
    ) -> None:
        self.caches, self.layout, self.step = caches, layout, step
        self.slots = slots.to(caches[0].device)
        size = _FRAME_HEADER.size + min(slots.numel(), step) * layout.layer_token_bytes
        tensors = [torch.empty(size, dtype=torch.uint8) for _ in range(_BUFFERS)]
        self.buffers: list[_Buffer] = [(t, memoryview(t.numpy())) for t in tensors]

    def __iter__(self) -> Iterator[_Frame]:
        total = self.slots.numel()
        for layer in range(self.layout.num_layers):
            for first in range(0, total, self.step):
                n = min(self.step, total - first)
                yield layer, first, n, n * self.layout.layer_token_bytes

    @staticmethod
    def wire(frame: _Frame, buf: _Buffer) -> memoryview:
        """The frame as sent: header, then payload."""
        return buf[1][: _FRAME_HEADER.size + frame[3]]

    def pack(self, frame: _Frame, buf: _Buffer) -> None:
        """Server: gather the frame's rows from the cache, checksum them, write the header."""
        layer, first, n, size = frame
        cache, rows, index = self._views(frame, buf)
        if cache.is_cpu:
            torch.index_select(cache, 1, index, out=rows)
        else:
            rows.copy_(cache.index_select(1, index))
        crc = _checksum(buf[1][_FRAME_HEADER.size : _FRAME_HEADER.size + size])
        _FRAME_HEADER.pack_into(buf[1], 0, layer, first, n, crc)

    def unpack(self, frame: _Frame, buf: _Buffer) -> None:
        """Fetcher: check a received frame's header and checksum, then scatter its rows."""
        got = _FRAME_HEADER.unpack_from(buf[1], 0)
        if got[:3] != frame[:3]:
            raise _WireError(f"expected frame (layer, first, tokens) {frame[:3]}, got {got[:3]}")
        if _checksum(buf[1][_FRAME_HEADER.size : _FRAME_HEADER.size + frame[3]]) != got[3]:
            where = f"layer {frame[0]}, tokens {frame[1]}..{frame[1] + frame[2] - 1}"
            raise KVTransferError(Reason.CHECKSUM, f"checksum differs in {where}")
        cache, rows, index = self._views(frame, buf)
        cache.index_copy_(1, index, rows.to(cache.device))

    def _views(self, frame: _Frame, buf: _Buffer) -> tuple[torch.Tensor, ...]:
        """The layer's flat cache, the frame's [2, tokens, heads, dim] rows, their slots."""
        layer, first, n, size = frame
        heads, dim, dtype = self.layout.num_kv_heads, self.layout.head_dim, self.layout.dtype
        payload = buf[0][_FRAME_HEADER.size : _FRAME_HEADER.size + size]
        rows = payload.view(dtype).view(2, n, heads, dim)
        return self.caches[layer].view(2, -1, heads, dim), rows, self.slots[first : first + n]


def _pipeline(
    frames: _Frames,
    fill: Callable[[_Frame, _Buffer], None],
    drain: Callable[[_Frame, _Buffer], None],
) -> None:
    """fill(frame) here and drain(frame) on a helper thread, overlapped over a few buffers.

    The server gathers and checksums a frame while the last one is sent; the fetcher
    receives a frame while the last one is verified and copied. The first error on
    either side stops both and is raised once the helper is done: nothing touches a
    cache after this returns.
    """
    free: queue.SimpleQueue[_Buffer] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[_Frame, _Buffer] | None] = queue.SimpleQueue()
    for buf in frames.buffers:
        free.put(buf)
    failed: list[BaseException] = []

    def helper() -> None:
        _one_intra_op_thread()
        while (item := full.get()) is not None:
            if not failed:  # after a failure, only hand the buffers back
                try:
                    drain(*item)
                except BaseException as exc:
                    failed.append(exc)
            free.put(item[1])

    thread = threading.Thread(target=helper, name="kv-drain")
    thread.start()
    try:
        for frame in frames:
            buf = free.get()
            if failed:
                break
            fill(frame, buf)
            full.put((frame, buf))
    except BaseException as exc:
        failed.append(exc)
    finally:
        full.put(None)
        thread.join()
    if failed:
        raise failed[0]


def _one_intra_op_thread() -> None:
    # Transfers copy memory; an OpenMP team each would only fight the engine's step (and
    # each other) for cores. Under OpenMP, torch's thread count is per calling thread.
    if torch.backends.openmp.is_available():
        torch.set_num_threads(1)


# --------------------------------------------------------------------- wire


class _WireError(Exception):
    """The peer sent something this side cannot read."""


def _tune(sock: socket.socket) -> None:
    # Frames go out whole; Nagle would only hold back each transfer's last packet.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)


def _send_msg(sock: socket.socket, body: dict[str, Any], deadline: float | None) -> None:
    data = json.dumps({"v": WIRE_VERSION, **body}).encode()
    if deadline is not None:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(_MSG_HEADER.pack(_MAGIC, len(data)) + data)


def _recv_msg(sock: socket.socket, deadline: float | None) -> dict[str, Any]:
    header = bytearray(_MSG_HEADER.size)
    _recv_exact(sock, memoryview(header), deadline)
    magic, length = _MSG_HEADER.unpack(header)
    if magic != _MAGIC or length > _MAX_MESSAGE:
        raise _WireError(f"not a KV transfer message (magic {magic!r}, {length} bytes)")
    body = bytearray(length)
    _recv_exact(sock, memoryview(body), deadline)
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise _WireError(f"unreadable message: {exc}") from None
    if not isinstance(message, dict):
        raise _WireError(f"expected a JSON object, got {message!r:.100}")
    return message


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    """Fill view from the socket; without a deadline, its timeout bounds each read."""
    got, size = 0, len(view)
    while got < size:
        if deadline is not None:
            if (left := deadline - time.monotonic()) <= 0:
                raise TimeoutError(f"deadline passed after {got} of {size} bytes")
            sock.settimeout(left)
        if (n := sock.recv_into(view[got:])) == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        got += n


def _checksum(payload: memoryview) -> int:
    """xxh3-64 of a frame: ~40 GB/s on one core, where zlib's software crc32 managed
    ~3.5 and cost more CPU than the copy itself. Not cryptographic: it is there to
    catch torn, corrupted or mixed-up frames, not an attacker on the pod network."""
    return xxhash.xxh3_64_intdigest(payload)
