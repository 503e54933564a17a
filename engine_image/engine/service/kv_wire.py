"""The TCP wire format of KV transfers: messages, frames, checksums (see kv_transfer)."""

from __future__ import annotations

import json
import queue
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import xxhash

from tandem.engine.service.kv_transfer import KVLayout, KVTransferError, Reason

WIRE_VERSION = 2  # 2: 64-bit xxh3 frame checksums (1 had crc32)
MAGIC = b"TKVM"
MSG_HEADER = struct.Struct("!4sI")
FRAME_HEADER = struct.Struct("!IIIQ")  # layer, first token, tokens, xxh3-64 of the payload
MAX_MESSAGE = 64 << 10
# Large enough that per-frame Python costs vanish, small enough that gather, checksum
# and send work on cache-warm data and overlap; a client refuses frames over the max.
DEFAULT_FRAME_BYTES = 1 << 20
MAX_FRAME_BYTES = 256 << 20
BUFFERS = 3  # per transfer: one being filled, one being drained, one spare
# Links need more than the default window to stay busy; Linux caps it at rmem/wmem_max.
SOCKET_BUFFER = 4 << 20


def check_reply(reply: dict[str, Any], num_tokens: int, layout: KVLayout) -> int:
    """The server's frame size in tokens, once its reply is what this fetch expects."""
    if reply.get("v") != WIRE_VERSION:
        raise WireError(f"server speaks wire version {reply.get('v')!r}, not {WIRE_VERSION}")
    if not reply.get("ok"):
        raise_refusal(reply)
    theirs = (reply.get("layout"), reply.get("byteorder"), reply.get("num_tokens"))
    if theirs != (layout.to_dict(), sys.byteorder, num_tokens):
        raise KVTransferError(
            Reason.MISMATCH,
            f"server offers (layout, byte order, tokens) {theirs!r:.300}, this side "
            f"expects {(layout.to_dict(), sys.byteorder, num_tokens)}",
        )
    frame_tokens = reply.get("frame_tokens")
    if not isinstance(frame_tokens, int) or not (
        0 < frame_tokens * layout.layer_token_bytes <= MAX_FRAME_BYTES
    ):
        raise WireError(f"bad frame size {frame_tokens!r:.20} tokens")
    return frame_tokens


def raise_refusal(reply: dict[str, Any]) -> None:
    reason = reply.get("reason")
    reason = reason if reason in tuple(Reason) else Reason.PROTOCOL
    raise KVTransferError(reason, f"server refused: {reply.get('error', reply)!s:.500}")


# ------------------------------------------------------------------- frames

Frame = tuple[int, int, int, int]  # layer, first token, tokens, payload bytes
Buffer = tuple[torch.Tensor, memoryview]  # one frame's header + payload, two views


class Frames:
    """One transfer's frames, layer by layer, and the few buffers they pass through."""

    def __init__(
        self, caches: list[torch.Tensor], slots: torch.Tensor, layout: KVLayout, step: int
    ) -> None:
        self.caches, self.layout, self.step = caches, layout, step
        self.slots = slots.to(caches[0].device)
        size = FRAME_HEADER.size + min(slots.numel(), step) * layout.layer_token_bytes
        tensors = [torch.empty(size, dtype=torch.uint8) for _ in range(BUFFERS)]
        self.buffers: list[Buffer] = [(t, memoryview(t.numpy())) for t in tensors]

    def __iter__(self) -> Iterator[Frame]:
        total = self.slots.numel()
        for layer in range(self.layout.num_layers):
            for first in range(0, total, self.step):
                n = min(self.step, total - first)
                yield layer, first, n, n * self.layout.layer_token_bytes

    @staticmethod
    def wire(frame: Frame, buf: Buffer) -> memoryview:
        """The frame as sent: header, then payload."""
        return buf[1][: FRAME_HEADER.size + frame[3]]

    def pack(self, frame: Frame, buf: Buffer) -> None:
        """Server: gather the frame's rows from the cache, checksum them, write the header."""
        layer, first, n, size = frame
        cache, rows, index = self._views(frame, buf)
        if cache.is_cpu:
            torch.index_select(cache, 1, index, out=rows)
        else:
            rows.copy_(cache.index_select(1, index))
        crc = checksum(buf[1][FRAME_HEADER.size : FRAME_HEADER.size + size])
        FRAME_HEADER.pack_into(buf[1], 0, layer, first, n, crc)

    def unpack(self, frame: Frame, buf: Buffer) -> None:
        """Fetcher: check a received frame's header and checksum, then scatter its rows."""
        got = FRAME_HEADER.unpack_from(buf[1], 0)
        if got[:3] != frame[:3]:
            raise WireError(f"expected frame (layer, first, tokens) {frame[:3]}, got {got[:3]}")
        if checksum(buf[1][FRAME_HEADER.size : FRAME_HEADER.size + frame[3]]) != got[3]:
            where = f"layer {frame[0]}, tokens {frame[1]}..{frame[1] + frame[2] - 1}"
            raise KVTransferError(Reason.CHECKSUM, f"checksum differs in {where}")
        cache, rows, index = self._views(frame, buf)
        cache.index_copy_(1, index, rows.to(cache.device))

    def _views(self, frame: Frame, buf: Buffer) -> tuple[torch.Tensor, ...]:
        """The layer's flat cache, the frame's [2, tokens, heads, dim] rows, their slots."""
        layer, first, n, size = frame
        heads, dim, dtype = self.layout.num_kv_heads, self.layout.head_dim, self.layout.dtype
        payload = buf[0][FRAME_HEADER.size : FRAME_HEADER.size + size]
        rows = payload.view(dtype).view(2, n, heads, dim)
        return self.caches[layer].view(2, -1, heads, dim), rows, self.slots[first : first + n]


def pipeline(
    frames: Frames,
    fill: Callable[[Frame, Buffer], None],
    drain: Callable[[Frame, Buffer], None],
) -> None:
    """fill(frame) here and drain(frame) on a helper thread, overlapped over a few buffers.

    The server gathers and checksums a frame while the last one is sent; the fetcher
    receives a frame while the last one is verified and copied. The first error on
    either side stops both and is raised once the helper is done: nothing touches a
    cache after this returns.
    """
    free: queue.SimpleQueue[Buffer] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[Frame, Buffer] | None] = queue.SimpleQueue()
    for buf in frames.buffers:
        free.put(buf)
    failed: list[BaseException] = []

    def helper() -> None:
        one_intra_op_thread()
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


def one_intra_op_thread() -> None:
    # Transfers copy memory; an OpenMP team each would only fight the engine's step (and
    # each other) for cores. Under OpenMP, torch's thread count is per calling thread.
    if torch.backends.openmp.is_available():
        torch.set_num_threads(1)


# --------------------------------------------------------------------- wire


class WireError(Exception):
    """The peer sent something this side cannot read."""


def tune(sock: socket.socket) -> None:
    # Frames go out whole; Nagle would only hold back each transfer's last packet.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def send_msg(sock: socket.socket, body: dict[str, Any], deadline: float | None) -> None:
    data = json.dumps({"v": WIRE_VERSION, **body}).encode()
    if deadline is not None:
        sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock.sendall(MSG_HEADER.pack(MAGIC, len(data)) + data)


def recv_msg(sock: socket.socket, deadline: float | None) -> dict[str, Any]:
    header = bytearray(MSG_HEADER.size)
    recv_exact(sock, memoryview(header), deadline)
    magic, length = MSG_HEADER.unpack(header)
    if magic != MAGIC or length > MAX_MESSAGE:
        raise WireError(f"not a KV transfer message (magic {magic!r}, {length} bytes)")
    body = bytearray(length)
    recv_exact(sock, memoryview(body), deadline)
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the stack
        raise WireError(f"unreadable message: {exc}") from None
    if not isinstance(message, dict):
        raise WireError(f"expected a JSON object, got {message!r:.100}")
    return message


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
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


def checksum(payload: memoryview) -> int:
    """xxh3-64 of a frame: ~40 GB/s on one core, where zlib's software crc32 managed
    ~3.5 and cost more CPU than the copy itself. Not cryptographic: it is there to
    catch torn, corrupted or mixed-up frames, not an attacker on the pod network."""
    return xxhash.xxh3_64_intdigest(payload)
