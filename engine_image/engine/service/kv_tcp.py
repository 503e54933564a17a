"""The TCP KV transport: KVServer (PROMPT engines) and fetch_kv (COMPLETION engines)."""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tandem.engine.service.kv_transfer import (
    KVLayout,
    KVTransferError,
    Lookup,
    OnFetched,
    PinnedKV,
    Reason,
    TransferStats,
)
from tandem.engine.service.kv_wire import (
    DEFAULT_FRAME_BYTES,
    WIRE_VERSION,
    Buffer,
    Frame,
    Frames,
    WireError,
    check_reply,
    one_intra_op_thread,
    pipeline,
    raise_refusal,
    recv_exact,
    recv_msg,
    send_msg,
    tune,
)

log = logging.getLogger(__name__)

# A fetcher sends its request as soon as it connects: a peer silent longer held one of
# the few transfer threads for the 30 s of a read, and four of them every fetch.
REQUEST_WITHIN_S = 2.0
# How often a transfer checks that its offer still holds: one that expired (or was
# withdrawn) midway stops there, not after sending every frame of freed blocks.
RECHECK_S = 0.05
_FIRST_PAUSE_S, _MOST_PAUSE_S = 0.05, 1.0  # between accept() retries


class KVServer:
    """Serves the pinned KV in this engine's caches to fetchers, a bounded pool at a time.

    Transfers only read rows of pinned requests, which the engine's main thread leaves
    alone while it steps on other blocks; they reach it only through the callbacks.
    lookup(handle) runs on transfer threads and returns the pinned KV or None (unknown
    or expired); it must be thread-safe, and the engine must drop a handle from it
    *before* freeing the handle's blocks. on_fetched(handle) runs on a transfer thread
    once the fetcher confirmed that all the KV arrived, or a decoder released the offer
    unfetched (release_kv); it may come twice for a handle fetched twice. on_sent(n), if
    given, runs on a transfer thread after each frame went out, with its KV bytes
    (headers and messages not counted). on_failure(why), if given, runs for each
    connection not served to its end: "refused" (an unknown handle, another layout...),
    "ended_early" (closed, garbage, too slow), "busy" (the queue full), "stale" (its
    turn came too late) or "accept" (accept() failed).

    A peer cannot hold it: a fetch request must arrive whole within REQUEST_WITHIN_S
    of its turn, the ack within io_timeout of the last frame; a connection that waited
    longer than `stale_after` for a turn is closed unserved (its fetcher has given up),
    and past `max_queued` waiting connections new ones are closed at once (their
    fetchers recompute). A failed accept() (out of descriptors) is retried.
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
        max_queued: int = 64,
        io_timeout: float = 30.0,
        stale_after: float = 10.0,
        frame_bytes: int = DEFAULT_FRAME_BYTES,
        on_sent: Callable[[int], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        layout.check_caches(kv_caches)
        if (
            max_connections < 1
            or max_queued < 0
            or io_timeout <= 0
            or stale_after <= 0
            or frame_bytes < 1
        ):
            raise ValueError(
                "KVServer needs max_connections >= 1, max_queued >= 0, io_timeout > 0, "
                f"stale_after > 0 and frame_bytes >= 1, got {max_connections}, {max_queued}, "
                f"{io_timeout}, {stale_after}, {frame_bytes}"
            )
        self._caches, self._layout = kv_caches, layout
        self._lookup, self._on_fetched = lookup, on_fetched
        self._on_sent = on_sent or (lambda n: None)
        self._on_failure = on_failure or (lambda why: None)
        self._bind, self._advertise_host = (host, port), advertise_host
        self._max_connections, self._io_timeout = max_connections, io_timeout
        self._most_open, self._stale_after = max_connections + max_queued, stale_after
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
        workers = ThreadPoolExecutor(self._max_connections, "kv-serve", one_intra_op_thread)
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
        pause, failing = _FIRST_PAUSE_S, False
        while True:
            try:
                conn, peer = listener.accept()
            except OSError as exc:
                if self._listener is not listener:
                    return  # stop() closed the listener
                # Out of descriptors (EMFILE), say: returning here ended the KV server for
                # good, every later handoff recomputed, and nothing said so.
                if not failing:  # once a streak: a retry is not another connection lost
                    self._on_failure("accept")
                    log.warning("KV server: accept failed (%s); retrying", exc)
                failing = True
                time.sleep(pause)
                pause = min(pause * 2, _MOST_PAUSE_S)
                continue
            pause, failing = _FIRST_PAUSE_S, False
            with self._lock:
                busy = len(self._open) >= self._most_open
                if not busy:
                    self._open.add(conn)
            if busy:  # its fetcher sees the connection closed and recomputes at once
                self._on_failure("busy")
                conn.close()
                continue
            workers.submit(self._serve, conn, peer, time.monotonic())

    def _serve(self, conn: socket.socket, peer: Any, accepted_at: float) -> None:
        try:
            if time.monotonic() - accepted_at > self._stale_after:
                self._on_failure("stale")
                log.info("KV fetch from %s waited past %gs for a turn", peer, self._stale_after)
                return
            tune(conn)
            conn.settimeout(self._io_timeout)
            request = recv_msg(conn, time.monotonic() + REQUEST_WITHIN_S)
            conn.settimeout(self._io_timeout)  # the deadline's read left its own timeout set
            if request.get("op") == "release":
                self._serve_release(conn, request)
            else:
                self._serve_fetch(conn, peer, request)
        except (OSError, WireError) as exc:
            self._on_failure("ended_early")
            log.info("KV fetch from %s ended early: %s", peer, exc)
        except Exception:  # a bug: log it; the fetcher sees a dropped connection
            self._on_failure("ended_early")
            log.exception("KV fetch from %s failed", peer)
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _serve_release(self, conn: socket.socket, request: dict[str, Any]) -> None:
        """A decoder that will not fetch the KV (it recomputes the prompt): free it now,
        as an ack does, not at the offer's expiry. The offer's token, as for a fetch."""
        if request.get("v") != WIRE_VERSION:  # as a fetch is: another version is refused
            send_msg(conn, {"ok": False, "reason": Reason.PROTOCOL}, None)
            return
        handle = request.get("handle")
        pinned = self._lookup(handle) if isinstance(handle, str) else None
        if pinned is None or not _token_matches(request.get("token"), pinned.token):
            send_msg(conn, {"ok": False, "reason": Reason.REFUSED}, None)  # gone already
            return
        self._on_fetched(pinned.handle)
        send_msg(conn, {"ok": True}, None)

    def _serve_fetch(self, conn: socket.socket, peer: Any, request: dict[str, Any]) -> None:
        pinned, refusal = self._admit(request)
        if pinned is None:
            log.info("KV fetch from %s refused: %s", peer, refusal["error"])
            send_msg(conn, {"ok": False, **refusal}, None)
            self._on_failure("refused")  # after the reply: a send that fails is ended_early
            return
        layout, num_tokens, frame_tokens = self._layout, pinned.slots.numel(), self._frame_tokens
        reply = {"ok": True, "layout": layout.to_dict(), "num_tokens": num_tokens}
        send_msg(conn, {**reply, "frame_tokens": frame_tokens, "byteorder": sys.byteorder}, None)
        frames = Frames(self._caches, pinned.slots, layout, frame_tokens)

        def send(frame: Frame, buf: Buffer) -> None:
            conn.sendall(frames.wire(frame, buf))
            self._on_sent(frame[3])  # sent, whatever becomes of the transfer

        next_check = time.monotonic() + RECHECK_S

        def pack(frame: Frame, buf: Buffer) -> None:
            nonlocal next_check
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + RECHECK_S
                if not self._still_pinned(pinned):
                    raise _Released
            frames.pack(frame, buf)

        try:
            pipeline(frames, pack, send)
        except _Released:  # closing tells the fetcher at once: it recomputes
            self._on_failure("refused")
            log.info(
                "KV of handle %r released during its transfer to %s: stopped", pinned.handle, peer
            )
            return
        # The rows were read while pinned only if the handle is still there: the engine
        # drops it from lookup before it frees (and reuses) its blocks.
        if not self._still_pinned(pinned):
            error = f"the KV of handle {pinned.handle!r} was released during the transfer"
            send_msg(conn, {"ok": False, "reason": Reason.REFUSED, "error": error}, None)
            self._on_failure("refused")
            return
        send_msg(conn, {"ok": True}, None)
        ack = recv_msg(conn, time.monotonic() + self._io_timeout)  # a trickle too
        if ack.get("op") != "ack" or ack.get("handle") != pinned.handle:
            raise WireError(f"expected an ack for {pinned.handle!r}, got {ack!r:.200}")
        try:
            self._on_fetched(pinned.handle)
        except Exception:
            log.exception("on_fetched(%r) failed", pinned.handle)

    def _still_pinned(self, pinned: PinnedKV) -> bool:
        again = self._lookup(pinned.handle)
        return again is not None and torch.equal(again.slots, pinned.slots)

    def _admit(self, request: dict[str, Any]) -> tuple[PinnedKV | None, dict[str, str]]:
        """The pinned KV a request may fetch, or None and why not (reason, error)."""
        handle, want = request.get("handle"), self._layout.to_dict()
        pinned = self._lookup(handle) if isinstance(handle, str) else None
        if request.get("v") != WIRE_VERSION or request.get("op") != "fetch":
            shown = {k: v for k, v in request.items() if k != "token"}  # logged: keep it out
            why = Reason.PROTOCOL, f"expected a wire version {WIRE_VERSION} fetch: {shown!r:.200}"
        elif request.get("layout") != want:
            why = Reason.MISMATCH, f"KV layout {request.get('layout')!r:.200}, server's {want}"
        elif pinned is None or not _token_matches(request.get("token"), pinned.token):
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


def _token_matches(given: object, token: str) -> bool:
    # In constant time: a reply's delay must not tell how much of a guess was right.
    # surrogatepass: a JSON string may hold a lone surrogate (not UTF-8), which must read
    # as a token that does not match, not raise (a traceback, no refusal sent).
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode())


class _Released(Exception):
    """The offer of the KV being sent went away midway (expired, withdrawn)."""


def fetch_kv(
    address: str,
    handle: str,
    token: str,
    fingerprint: str,
    num_tokens: int,
    dest_slots: torch.Tensor,
    kv_caches: list[torch.Tensor],
    layout: KVLayout,
    timeout: float,
) -> TransferStats:
    """Copy the KV of `handle` (whose offer's secret is `token`) from the KV server at
    `address` into dest_slots.

    dest_slots: long [num_tokens], the flat cache slots (position order) of the blocks
    reserved for the request. `timeout` bounds each wait: for the connection and the
    reply, then for each read of the frames (a transfer that keeps flowing is not cut:
    a long prompt's KV takes what the link needs, the offer's expiry the only bound).
    Raises KVTransferError on any failure, after which those rows are garbage;
    ValueError for bad arguments.
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
    request = {"op": "fetch", "handle": handle, "token": token, "fingerprint": fingerprint}
    answered = False
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout) as sock:
            tune(sock)
            send_msg(
                sock, {**request, "num_tokens": num_tokens, "layout": layout.to_dict()}, deadline
            )
            frame_tokens = check_reply(recv_msg(sock, deadline), num_tokens, layout)
            answered = True
            frames = Frames(kv_caches, dest_slots, layout, frame_tokens)
            sock.settimeout(timeout)  # each read from here on, not the whole transfer

            def receive(frame: Frame, buf: Buffer) -> None:
                recv_exact(sock, frames.wire(frame, buf), None)

            pipeline(frames, receive, frames.unpack)
            if not (trailer := recv_msg(sock, None)).get("ok"):
                raise_refusal(trailer)
            # The KV is complete and was pinned while read: a lost ack only leaves the
            # server to free it at expiry, no reason to recompute.
            with contextlib.suppress(OSError):
                send_msg(sock, {"op": "ack", "handle": handle}, None)
    except KVTransferError as exc:
        raise KVTransferError(exc.reason, f"{address}, handle {handle!r}: {exc.detail}") from None
    except TimeoutError as exc:
        if answered:
            stalled = f"{address} sent nothing for {timeout} s mid-transfer"
            raise KVTransferError(Reason.TIMEOUT, stalled) from exc
        unanswered = f"{address} did not answer within {timeout} s"
        raise KVTransferError(Reason.TIMEOUT, unanswered, unanswered=True) from exc
    except WireError as exc:
        raise KVTransferError(Reason.PROTOCOL, f"{address}: {exc}") from exc
    except OSError as exc:
        raise KVTransferError(Reason.UNREACHABLE, f"{address}: {exc}") from exc
    seconds = time.perf_counter() - start
    return TransferStats(num_tokens * layout.bytes_per_token, seconds, layout.num_layers)


def release_kv(address: str, handle: str, token: str, timeout: float) -> bool:
    """Tell the prompt engine at `address` that nobody will fetch its KV of `handle`
    (this decoder recomputes the prompt): it frees the KV now, not at the offer's
    expiry. Best effort: False where it did not answer or held no such offer."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout) as sock:
            send_msg(sock, {"op": "release", "handle": handle, "token": token}, deadline)
            return recv_msg(sock, deadline).get("ok") is True
    except (OSError, WireError, ValueError):
        return False
