"""KV transfer between a PROMPT and a COMPLETION engine over real localhost sockets."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest
import torch

from tandem.engine.service.kv_handoff import KVFetches
from tandem.engine.service.kv_tcp import KVServer, fetch_kv, release_kv
from tandem.engine.service.kv_transfer import KVLayout, KVTransferError, PinnedKV, TransferStats
from tandem.engine.service.kv_wire import MAGIC, MSG_HEADER, recv_msg
from tandem.engine.service.serve import kv_fingerprint

pytestmark = pytest.mark.timeout(30)

BLOCKS, BLOCK_SIZE = 16, 4
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
TOKENS = 37  # ends in a partial block
LAYER_BYTES = TOKENS * LAYOUT.layer_token_bytes
TOKEN = "offer-secret"  # the token of every offer below but where a test says


def caches(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim)
    return [torch.randn(shape, generator=gen).to(layout.dtype) for _ in range(layout.num_layers)]


def scattered_slots(num_tokens: int, seed: int) -> torch.Tensor:
    """Slots of positions 0..num_tokens-1 on a random block table, as an engine has them."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(BLOCKS, generator=gen)[: -(-num_tokens // BLOCK_SIZE)]
    positions = torch.arange(num_tokens)
    return table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


def rows(kv_caches: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [c.view(2, -1, c.shape[3], c.shape[4])[:, slots] for c in kv_caches]


class Offers:
    """What a PROMPT engine gives the server: pinned KV by handle, and fetched handles."""

    def __init__(self, *pinned: PinnedKV) -> None:
        self.pinned = {p.handle: p for p in pinned}
        self.fetched: list[str] = []
        self.any_fetched = threading.Event()

    def lookup(self, handle: str) -> PinnedKV | None:
        return self.pinned.get(handle)

    def on_fetched(self, handle: str) -> None:
        self.fetched.append(handle)
        self.any_fetched.set()


@contextmanager
def serving(src: list[torch.Tensor], offers: Offers, **options: object) -> Iterator[KVServer]:
    server = KVServer(src, LAYOUT, offers.lookup, offers.on_fetched, "127.0.0.1", **options)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_copies_exactly_the_requests_rows(dtype):
    layout = KVLayout(3, 2, 8, dtype)
    src, dst = caches(layout, seed=1), caches(layout, seed=2)
    before = [c.clone() for c in dst]
    src_slots, dst_slots = scattered_slots(TOKENS, seed=3), scattered_slots(TOKENS, seed=4)
    offers = Offers(PinnedKV("req-1", src_slots, "fp", TOKEN))
    # Frames of 3 tokens: every layer takes many frames, the last one partial.
    sent: list[int] = []  # the PROMPT engine's tandem_engine_kv_served_bytes_total
    server = KVServer(
        src,
        layout,
        offers.lookup,
        offers.on_fetched,
        "127.0.0.1",
        frame_bytes=200,
        on_sent=sent.append,
    )
    address = server.start()
    try:
        stats = fetch_kv(address, "req-1", TOKEN, "fp", TOKENS, dst_slots, dst, layout, timeout=10)
        assert offers.any_fetched.wait(5)
    finally:
        server.stop()
    assert offers.fetched == ["req-1"]
    assert (stats.bytes, stats.layers) == (TOKENS * layout.bytes_per_token, 3)
    assert sum(sent) == stats.bytes and len(sent) > 3  # counted frame by frame
    for got, want in zip(rows(dst, dst_slots), rows(src, src_slots), strict=True):
        assert torch.equal(got, want)
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[dst_slots] = False
    for got, old in zip(dst, before, strict=True):
        flat, old_flat = got.view(2, -1, 2, 8), old.view(2, -1, 2, 8)
        assert torch.equal(flat[:, untouched], old_flat[:, untouched])


def fetch_error(address: str, handle: str = "req-1", **overrides: object) -> KVTransferError:
    args = dict(token=TOKEN, fingerprint="fp", num_tokens=TOKENS)
    args.update(dest_slots=scattered_slots(TOKENS, 4))
    args.update(kv_caches=caches(LAYOUT, 2), layout=LAYOUT, timeout=5.0)
    args.update(overrides)
    with pytest.raises(KVTransferError) as info:
        fetch_kv(address, handle, **args)  # type: ignore[arg-type]
    return info.value


@pytest.mark.parametrize(
    ("case", "reason", "words"),
    [
        ("unknown handle", "refused", "unknown or expired"),
        # A wrong or missing token reads as an unknown handle, whatever else the fetch
        # gets wrong after it: a guess learns nothing of which handles exist.
        ("wrong token", "refused", "unknown or expired"),
        ("no token", "refused", "unknown or expired"),
        # Valid JSON, no UTF-8: it raised in the comparison (a traceback, no reply).
        ("lone surrogate token", "refused", "unknown or expired"),
        ("wrong token and fingerprint", "refused", "unknown or expired"),
        ("fingerprint", "mismatch", "fingerprint"),
        ("token count", "mismatch", "tokens"),
        ("layout", "mismatch", "layout"),
    ],
)
def test_refusals_raise_their_reason_and_free_nothing(case, reason, words):
    offers = Offers(PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN))
    other = KVLayout(3, 2, 16, torch.float32)
    overrides = {
        "unknown handle": {"handle": "nope"},
        "wrong token": {"token": TOKEN[:-1] + "?"},
        "no token": {"token": ""},
        "lone surrogate token": {"token": "\ud800"},
        "wrong token and fingerprint": {"token": "guess", "fingerprint": "other-weights"},
        "fingerprint": {"fingerprint": "other-weights"},
        "token count": {"num_tokens": TOKENS - 1, "dest_slots": scattered_slots(TOKENS - 1, 4)},
        "layout": {"layout": other, "kv_caches": caches(other, 2)},
    }[case]
    sent: list[int] = []
    with serving(caches(LAYOUT, 1), offers, on_sent=sent.append) as server:
        error = fetch_error(server.address, **overrides)
    assert error.reason == reason
    assert sent == []  # refused: no KV went out
    assert words in str(error)
    assert offers.fetched == []  # stop() waited for the server's threads


def test_kv_released_during_the_transfer_is_refused():
    pinned = PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN)
    offers = Offers(pinned)
    looked_up = []

    def lookup(handle: str) -> PinnedKV | None:
        looked_up.append(handle)
        return pinned if len(looked_up) == 1 else None  # expired after the first look

    server = KVServer(caches(LAYOUT, 1), LAYOUT, lookup, offers.on_fetched, "127.0.0.1")
    server.start()
    try:
        error = fetch_error(server.address)
    finally:
        server.stop()
    assert error.reason == "refused"
    assert "released during the transfer" in str(error)
    assert offers.fetched == []


def test_kv_released_midway_stops_the_transfer_there():
    # Sent whole, then refused: the fetcher waited out the transfer to recompute anyway,
    # and the server went on reading blocks freed (another request's KV by then).
    pinned = PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN)
    offers = Offers(pinned)
    sent: list[int] = []

    def slow_link(frame_bytes: int) -> None:
        sent.append(frame_bytes)
        if len(sent) == 2:
            offers.pinned.clear()  # the offer expires while the frames go out
        time.sleep(0.02)

    with serving(caches(LAYOUT, 1), offers, frame_bytes=200, on_sent=slow_link) as server:
        error = fetch_error(server.address)
    frames = -(-TOKENS // (200 // LAYOUT.layer_token_bytes)) * LAYOUT.num_layers
    assert len(sent) < frames // 2  # stopped within a few frames, not after all of them
    assert error.reason == "unreachable"  # the connection closed midway: it recomputes
    assert offers.fetched == []


def test_nothing_listening_is_unreachable():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    assert fetch_error(f"127.0.0.1:{port}").reason == "unreachable"


def test_stopped_server_is_unreachable():
    offers = Offers(PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN))
    with serving(caches(LAYOUT, 1), offers) as server:
        address = server.address
    assert fetch_error(address).reason == "unreachable"
    assert offers.fetched == []


def test_stop_cuts_a_connection_that_never_asks():
    offers = Offers(PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN))
    with serving(caches(LAYOUT, 1), offers) as server:
        idle = socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1])))
        time.sleep(0.05)  # let a worker take it and wait for its request
        start = time.monotonic()
    elapsed = time.monotonic() - start
    assert idle.recv(1) == b""  # the server closed it
    idle.close()
    assert elapsed < 2  # not the 30 s io_timeout


def test_layout_of_caches():
    assert KVLayout.of(caches(LAYOUT, 1)) == LAYOUT
    strided = [c.transpose(3, 4) for c in caches(LAYOUT, 1)]
    with pytest.raises(ValueError, match="contiguous"):
        KVLayout.of(strided)
    with pytest.raises(ValueError, match="positive int"):
        KVLayout(0, 2, 8, torch.float32)


def test_silent_server_times_out():
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    port = silent.getsockname()[1]
    try:
        start = time.monotonic()
        error = fetch_error(f"127.0.0.1:{port}", timeout=0.3)
        elapsed = time.monotonic() - start
    finally:
        silent.close()
    assert error.reason == "timeout"
    assert elapsed < 2


class Proxy:
    """Relays one connection to `target`; cuts, corrupts or (`stall_s`) holds the
    server's bytes at an offset, stops reading them for `pause_s` after the first chunk
    (a busy fetcher), or relays them 1 KiB every `trickle_s` (a slow link)."""

    def __init__(
        self,
        target: str,
        at: int | None = None,
        corrupt: bool = False,
        pause_s: float = 0.0,
        trickle_s: float = 0.0,
        stall_s: float = 0.0,
    ) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.at, self.corrupt, self.pause_s, self.trickle_s = at, corrupt, pause_s, trickle_s
        self.stall_s = stall_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._relay, daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        client, _ = self.listener.accept()
        server = socket.socket()
        if self.pause_s:  # a small window: the server's sends block while paused
            server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        server.connect(self.target)
        threading.Thread(target=_pipe, args=(client, server), daemon=True).start()
        sent = 0
        try:
            while chunk := bytearray(server.recv(1 << 10 if self.trickle_s else 1 << 16)):
                if self.pause_s and sent == 0:
                    time.sleep(self.pause_s)
                time.sleep(self.trickle_s)
                if self.at is not None and sent <= self.at < sent + len(chunk):
                    if self.stall_s:
                        client.sendall(chunk[: self.at - sent])
                        time.sleep(self.stall_s)
                        client.sendall(chunk[self.at - sent :])
                        sent += len(chunk)
                        continue
                    if not self.corrupt:
                        client.sendall(chunk[: self.at - sent])
                        return  # the server "dies" mid-frame
                    chunk[self.at - sent] ^= 0x5A
                client.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the client gave up
        finally:
            for sock in (client, server):
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # close() would not wake _pipe's recv
                sock.close()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(5)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Client to server: requests and the ack; the client's end is passed on."""
    with suppress(OSError):  # a client that closes with unread data resets the connection
        while data := source.recv(1 << 16):
            sink.sendall(data)
    with suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@pytest.mark.parametrize(("corrupt", "reason"), [(False, "unreachable"), (True, "checksum")])
def test_server_dying_or_corrupting_mid_stream(corrupt, reason):
    offers = Offers(PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN))
    # One frame per layer; the offset lands mid-payload of layer 1's frame whatever the
    # few hundred bytes of JSON header before the frames.
    with serving(caches(LAYOUT, 1), offers, frame_bytes=1 << 20) as server:
        proxy = Proxy(server.address, at=LAYER_BYTES * 3 // 2 + 200, corrupt=corrupt)
        try:
            error = fetch_error(proxy.address)
        finally:
            proxy.close()
    assert error.reason == reason
    assert offers.fetched == []


def test_a_slow_transfer_that_keeps_flowing_is_not_cut_by_the_timeout():
    # The timeout bounded the whole fetch: a long prompt's KV over a slower link (tens
    # of GB for a large model's long context) could never arrive, and its prompt engine
    # was then skipped for 30 s as if it had stalled.
    src, slots = caches(LAYOUT, 1), scattered_slots(TOKENS, 3)
    with serving(src, Offers(PinnedKV("req-1", slots, "fp", TOKEN))) as server:
        proxy = Proxy(server.address, trickle_s=0.05)  # 14 KiB: ~0.7 s
        dst, dst_slots = caches(LAYOUT, 2), scattered_slots(TOKENS, 4)
        try:
            start = time.monotonic()
            fetch_kv(proxy.address, "req-1", TOKEN, "fp", TOKENS, dst_slots, dst, LAYOUT, 0.3)
            elapsed = time.monotonic() - start
        finally:
            proxy.close()
    assert elapsed > 0.3  # longer than the timeout, each read well within it
    for got, want in zip(rows(dst, dst_slots), rows(src, slots), strict=True):
        assert torch.equal(got, want)


def test_a_transfer_stalled_midway_times_out_as_answered():
    offers = Offers(PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN))
    with serving(caches(LAYOUT, 1), offers) as server:
        # Held mid-payload of layer 1's frame, past the reply (a few hundred bytes).
        proxy = Proxy(server.address, at=LAYER_BYTES * 3 // 2 + 200, stall_s=1.0)
        try:
            error = fetch_error(proxy.address, timeout=0.3)
        finally:
            proxy.close()
    assert (error.reason, error.unanswered) == ("timeout", False)
    assert "mid-transfer" in error.detail


def test_only_a_peer_that_did_not_answer_is_skipped_after_a_timeout():
    # A stall midway is a slow link or a busy peer, not a dead one: its next handoffs
    # are still fetched. One that never answered is skipped for a while.
    errors = iter(
        [
            KVTransferError("timeout", "sent nothing mid-transfer"),
            KVTransferError("timeout", "did not answer", unanswered=True),
        ]
    )

    def fetch(**_: object) -> None:
        raise next(errors)

    fetches = KVFetches(fetch, max_parallel=1)  # in turn, in order
    try:
        for i in range(3):
            fetches.start(f"r{i}", address="peer:1")
        outcomes: list = []
        deadline = time.monotonic() + 5
        while len(outcomes) < 3 and time.monotonic() < deadline:
            outcomes += fetches.done()
            time.sleep(0.01)
    finally:
        fetches.close()
    assert [o.error.reason for o in outcomes] == ["timeout", "timeout", "skipped"]


def test_a_suspect_peer_is_probed_and_asked_again_once_it_answers():
    # A prompt engine only busy (its transfer threads all taken, the fetch waiting in
    # its queue past the timeout) was skipped for 30 s, and the offers skipped stayed
    # pinned on it for nobody until they expired: it filled up and pulled no more work.
    unanswered = [KVTransferError("timeout", "did not answer", unanswered=True)]
    fetched: list[str] = []
    released: list[tuple[str, str]] = []

    def fetch(handle: str, **_: object) -> TransferStats:
        if unanswered:
            raise unanswered.pop()
        fetched.append(handle)
        return TransferStats(bytes=1, seconds=0.0, layers=1)

    def release(address: str, handle: str, token: str, timeout: float) -> bool:
        released.append((handle, token))
        return True

    fetches = KVFetches(fetch, max_parallel=1, release=release, probe_every_s=0.3)
    outcomes: dict = {}

    def run(rid: str) -> KVTransferError | None:
        fetches.start(rid, address="peer:1", handle=rid, token=f"t-{rid}")
        deadline = time.monotonic() + 5
        while rid not in outcomes and time.monotonic() < deadline:
            outcomes.update({o.request_id: o for o in fetches.done()})
            time.sleep(0.01)
        return outcomes[rid].error

    try:
        assert run("a").reason == "timeout"
        assert run("b").reason == "skipped"  # not asked: it may be stalled
        time.sleep(0.35)
        assert run("c") is None  # the probe: it answers, and is asked again
        assert run("d") is None
        deadline = time.monotonic() + 5
        while len(released) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        fetches.close()
    assert fetched == ["c", "d"]
    # The offers skipped and the one whose fetch timed out unanswered (which stayed
    # pinned for nobody until its TTL), freed on the prompt engine.
    assert sorted(released) == [("a", "t-a"), ("b", "t-b")]


class _FakeFetches:
    """KVFetches over a fetch function of the test's, its outcomes collected by id."""

    def __init__(self, fetch, probe_every_s: float) -> None:
        self.released: list[str] = []
        self.outcomes: dict = {}

        def release(address: str, handle: str, token: str, timeout: float) -> bool:
            self.released.append(handle)
            return True

        self.fetches = KVFetches(fetch, max_parallel=2, release=release,
                                 probe_every_s=probe_every_s)  # fmt: skip

    def start(self, rid: str, address: str) -> None:
        self.fetches.start(rid, address=address, handle=rid, token="t")

    def reason(self, rid: str) -> str | None:
        deadline = time.monotonic() + 5
        while rid not in self.outcomes and time.monotonic() < deadline:
            self.outcomes.update({o.request_id: o for o in self.fetches.done()})
            time.sleep(0.01)
        error = self.outcomes[rid].error
        return None if error is None else error.reason


def test_suspect_peers_are_probed_one_at_a_time():
    # A probe of a stalled peer holds a fetch thread for its whole timeout: each suspect
    # probed on its own, a zone cut off kept both threads busy for good.
    gate = threading.Event()
    started: list[str] = []

    def fetch(handle: str, **_: object) -> TransferStats:
        started.append(handle)
        if handle.startswith("probe"):
            gate.wait(5)  # a stalled peer: no answer until its timeout
        raise KVTransferError("timeout", "did not answer", unanswered=True)

    fake = _FakeFetches(fetch, probe_every_s=0.1)
    try:
        fake.start("first-a", "stalled:1")
        fake.start("first-b", "stalled:2")
        assert fake.reason("first-a") == fake.reason("first-b") == "timeout"
        time.sleep(0.15)  # both probes due
        fake.start("probe-a", "stalled:1")
        time.sleep(0.1)
        fake.start("probe-b", "stalled:2")
        assert fake.reason("probe-b") == "skipped"  # while probe-a runs
        gate.set()
        assert fake.reason("probe-a") == "timeout"
    finally:
        gate.set()
        fake.fetches.close()
    assert started == ["first-a", "first-b", "probe-a"]


def test_a_probe_that_finds_no_one_keeps_the_peer_skipped_and_releases_nothing():
    # Counted as an answer, the dead peer was asked again, and every offer skipped was
    # released to it, each holding a fetch thread until its own timeout.
    def fetch(handle: str, **_: object) -> TransferStats:
        if handle == "probe":
            raise KVTransferError("unreachable", "connection refused")
        raise KVTransferError("timeout", "did not answer", unanswered=True)

    fake = _FakeFetches(fetch, probe_every_s=0.1)
    try:
        fake.start("first", "gone:1")
        assert fake.reason("first") == "timeout"
        fake.start("skipped", "gone:1")
        assert fake.reason("skipped") == "skipped"
        time.sleep(0.15)
        fake.start("probe", "gone:1")
        assert fake.reason("probe") == "unreachable"
        fake.start("after", "gone:1")
        assert fake.reason("after") == "skipped"
        time.sleep(0.2)
    finally:
        fake.fetches.close()
    assert fake.released == []


def test_a_decoder_that_will_not_fetch_releases_the_offer_with_its_token():
    # A decoder recomputing a prompt (another model's KV) left the KV pinned on the
    # prompt engine until the offer expired: a rollout's mismatched pairs filled its pool.
    offers = Offers(PinnedKV("req-1", scattered_slots(TOKENS, 3), "fp", TOKEN))
    with serving(caches(LAYOUT, 1), offers) as server:
        assert not release_kv(server.address, "req-1", "a guess", timeout=5)
        assert not release_kv(server.address, "unknown", TOKEN, timeout=5)
        # Another wire version is refused, as its fetch is (a release was honoured).
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            body = json.dumps({"v": 1, "op": "release", "handle": "req-1", "token": TOKEN})
            conn.sendall(MSG_HEADER.pack(MAGIC, len(body)) + body.encode())
            assert recv_msg(conn, time.monotonic() + 5)["reason"] == "protocol"
        assert offers.fetched == []
        assert release_kv(server.address, "req-1", TOKEN, timeout=5)
        assert offers.fetched == ["req-1"]  # freed as a fetch's ack frees it
    silent = socket.create_server(("127.0.0.1", 0))
    try:  # nobody answers: best effort, never an error
        assert not release_kv(f"127.0.0.1:{silent.getsockname()[1]}", "req-1", TOKEN, 0.3)
    finally:
        silent.close()


@pytest.mark.parametrize(
    ("error", "released"),
    [
        (KVTransferError("checksum", "frame 3"), True),
        (KVTransferError("timeout", "sent nothing mid-transfer"), True),
        (KVTransferError("timeout", "did not answer", unanswered=True), False),  # stalled
        (KVTransferError("refused", "unknown handle"), False),  # it holds none
    ],
)
def test_a_fetch_that_broke_releases_the_offer_it_leaves_behind(error, released):
    # The decoder recomputes the prompt; the prompt engine kept the KV pinned for
    # nobody until the offer expired.
    asked: list[dict] = []

    def fetch(**_: object) -> None:
        raise error

    fetches = KVFetches(fetch, max_parallel=1, release=lambda **a: asked.append(a) or True)
    try:
        fetches.start("r", address="peer:1", handle="r", token=TOKEN, timeout=10)
        deadline = time.monotonic() + (2 if released else 0.3)
        while not asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [o.error.reason for o in fetches.done()] == [error.reason]
    finally:
        fetches.close()
    expected = [{"address": "peer:1", "handle": "r", "token": TOKEN, "timeout": 2.0}]
    assert asked == (expected if released else [])


def test_two_fetches_at_once_from_one_server():
    tokens = 60
    src = caches(LAYOUT, seed=1)
    slots = {"a": scattered_slots(tokens, 5), "b": scattered_slots(tokens, 6)}
    dests = {"a": scattered_slots(tokens, 7), "b": scattered_slots(tokens, 8)}
    dst = {h: caches(LAYOUT, seed=9) for h in slots}
    offers = Offers(*(PinnedKV(h, s, f"fp-{h}", TOKEN) for h, s in slots.items()))
    server = KVServer(src, LAYOUT, offers.lookup, offers.on_fetched, "127.0.0.1")
    address = server.start()
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def fetch(handle: str) -> None:
        start.wait()
        try:
            fetch_kv(
                address,
                handle,
                TOKEN,
                f"fp-{handle}",
                tokens,
                dests[handle],
                dst[handle],
                LAYOUT,
                10.0,
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch, args=(h,)) for h in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    server.stop()
    assert errors == []
    assert sorted(offers.fetched) == ["a", "b"]
    for handle in slots:
        for got, want in zip(
            rows(dst[handle], dests[handle]), rows(src, slots[handle]), strict=True
        ):
            assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"dest_slots": scattered_slots(TOKENS - 1, 4)}, "shape"),
        ({"dest_slots": torch.full((TOKENS,), BLOCKS * BLOCK_SIZE)}, "outside"),
        ({"dest_slots": scattered_slots(TOKENS, 4).int()}, "long"),
        ({"timeout": 0}, "timeout"),
        ({"kv_caches": caches(LAYOUT, 2)[:2]}, "2 KV caches"),
    ],
)
def test_bad_arguments_raise_value_error(overrides, words):
    args = dict(token=TOKEN, fingerprint="fp", num_tokens=TOKENS)
    args.update(dest_slots=scattered_slots(TOKENS, 4))
    args.update(kv_caches=caches(LAYOUT, 2), layout=LAYOUT, timeout=5.0)
    args.update(overrides)
    with pytest.raises(ValueError, match=words):
        fetch_kv("127.0.0.1:1", "req-1", **args)  # type: ignore[arg-type]


def test_address_without_port_raises_value_error():
    with pytest.raises(ValueError, match="host:port"):
        fetch_kv(
            "kv-server",
            "req-1",
            TOKEN,
            "fp",
            TOKENS,
            scattered_slots(TOKENS, 4),
            caches(LAYOUT, 2),
            LAYOUT,
            5.0,
        )


def test_a_silent_prompt_engine_does_not_hold_up_the_healthy_ones():
    # Four handoffs from a prompt engine that accepts connections and never answers,
    # then one from a healthy engine. On the two fetch threads each silent fetch took
    # its whole timeout, so the healthy one waited for two more of them.
    src = caches(LAYOUT, seed=1)
    offers = Offers(PinnedKV("good", scattered_slots(TOKENS, 3), "fp", TOKEN))
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody answers
    fetches = KVFetches(fetch_kv)  # two threads
    dst = caches(LAYOUT, seed=2)
    outcomes: dict = {}

    def start(rid: str, address: str) -> None:
        args = dict(handle=rid, token=TOKEN, fingerprint="fp", num_tokens=TOKENS, layout=LAYOUT)
        args.update(dest_slots=scattered_slots(TOKENS, 4), kv_caches=dst, timeout=1.0)
        fetches.start(rid, address=address, **args)

    def until(count: int) -> float:
        deadline = time.monotonic() + 10
        while len(outcomes) < count and time.monotonic() < deadline:
            outcomes.update({o.request_id: o for o in fetches.done()})
            time.sleep(0.01)
        return time.monotonic()

    try:
        with serving(src, offers) as server:
            for i in range(4):
                start(f"silent-{i}", f"127.0.0.1:{silent.getsockname()[1]}")
            timed_out = until(2)  # the first two, after their 1 s
            start("good", server.address)
            fetched = until(5)
    finally:
        silent.close()
        fetches.close()
    assert sorted(o.error.reason for o in outcomes.values() if o.error) == [
        "skipped",
        "skipped",
        "timeout",
        "timeout",
    ]
    assert outcomes["good"].stats is not None
    assert fetched - timed_out < 0.5  # not behind two more timeouts


# ------------------------------------------------------------------ hostile peers


def _port(server: KVServer) -> int:
    return int(server.address.rsplit(":", 1)[1])


def _fetch_ok(server: KVServer, src: list[torch.Tensor], slots: torch.Tensor) -> None:
    dst = caches(LAYOUT, 2)
    dst_slots = scattered_slots(TOKENS, 4)
    fetch_kv(server.address, "req-1", TOKEN, "fp", TOKENS, dst_slots, dst, LAYOUT, timeout=10)
    for got, want in zip(rows(dst, dst_slots), rows(src, slots), strict=True):
        assert torch.equal(got, want)


def test_silent_peers_hold_the_transfer_threads_two_seconds_not_thirty():
    # Four connections that never ask took the four threads for a 30 s read each: every
    # real fetch behind them timed out and recomputed, for as long as they stayed.
    src, slots = caches(LAYOUT, 1), scattered_slots(TOKENS, 3)
    failures: list[str] = []
    with serving(
        src, Offers(PinnedKV("req-1", slots, "fp", TOKEN)), on_failure=failures.append
    ) as s:
        silent = [socket.create_connection(("127.0.0.1", _port(s))) for _ in range(4)]
        try:
            started = time.monotonic()
            _fetch_ok(s, src, slots)
            assert time.monotonic() - started < 5  # REQUEST_WITHIN_S (2 s) and the fetch
        finally:
            for conn in silent:
                conn.close()
    assert failures.count("ended_early") == 4


def test_connections_past_the_queue_are_closed_at_once_and_counted():
    src, slots = caches(LAYOUT, 1), scattered_slots(TOKENS, 3)
    failures: list[str] = []
    offers = Offers(PinnedKV("req-1", slots, "fp", TOKEN))
    with serving(src, offers, max_connections=1, max_queued=1, on_failure=failures.append) as s:
        held = [socket.create_connection(("127.0.0.1", _port(s))) for _ in range(2)]
        extra = socket.create_connection(("127.0.0.1", _port(s)), timeout=5)
        try:
            assert extra.recv(1) == b""  # closed by the server, not left waiting
            assert failures == ["busy"]
        finally:
            for conn in (*held, extra):
                conn.close()


def test_a_fetch_that_waited_past_its_fetchers_patience_is_not_served():
    # Served after its fetcher gave up (it recomputes), it pinned nothing but cost a turn.
    src, slots = caches(LAYOUT, 1), scattered_slots(TOKENS, 3)
    failures: list[str] = []
    offers = Offers(PinnedKV("req-1", slots, "fp", TOKEN))
    with serving(src, offers, max_connections=1, stale_after=0.5, on_failure=failures.append) as s:
        silent = socket.create_connection(("127.0.0.1", _port(s)))  # holds the one thread 2 s
        try:
            time.sleep(0.1)
            late = socket.create_connection(("127.0.0.1", _port(s)), timeout=5)
            assert late.recv(1) == b""  # its turn came after 2 s: closed unserved
            late.close()
        finally:
            silent.close()
    assert sorted(failures) == ["ended_early", "stale"]
    assert offers.fetched == []


def test_a_failed_accept_is_retried_not_the_end_of_the_server():
    # Out of descriptors, accept() raised and the acceptor returned as if stopped: no
    # handoff was ever served again, and nothing said so.
    src, slots = caches(LAYOUT, 1), scattered_slots(TOKENS, 3)
    failures: list[str] = []
    with serving(
        src, Offers(PinnedKV("req-1", slots, "fp", TOKEN)), on_failure=failures.append
    ) as s:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        in_use = len(os.listdir("/proc/self/fd"))
        clients = subprocess.Popen(  # its own descriptors: only the server's run out
            [sys.executable, "-c", _HOLD_CONNECTIONS, str(_port(s))], stdout=subprocess.PIPE
        )
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 1, hard))
        try:
            assert clients.stdout.readline() == b"connected\n"
            deadline = time.monotonic() + 5
            while "accept" not in failures and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            clients.kill()
            clients.wait()
        assert "accept" in failures
        _fetch_ok(s, src, slots)  # served again once descriptors are back


_HOLD_CONNECTIONS = """
import socket, sys, time
conns = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(8)]
print("connected", flush=True)
time.sleep(60)
"""


def test_a_fetcher_slow_to_read_has_the_io_timeout_not_the_requests_two_seconds():
    # The request's 2 s deadline left its timeout on the socket: every later send had
    # 2 s, and a busy decoder that read its frames 3 s late lost the handoff.
    # 19 MB of KV: more than the server's socket buffer (up to 8 MB) holds.
    layout = KVLayout(num_layers=64, num_kv_heads=8, head_dim=128, dtype=torch.float32)
    src, slots = caches(layout, 1), scattered_slots(TOKENS, 3)
    failures: list[str] = []
    offers = Offers(PinnedKV("req-1", slots, "fp", TOKEN))
    server = KVServer(
        src, layout, offers.lookup, offers.on_fetched, "127.0.0.1", on_failure=failures.append
    )
    proxy = Proxy(server.start(), pause_s=3.0)
    try:
        dst, dst_slots = caches(layout, 2), scattered_slots(TOKENS, 4)
        stats = fetch_kv(proxy.address, "req-1", TOKEN, "fp", TOKENS, dst_slots, dst, layout, 10)
        assert offers.any_fetched.wait(5)
    finally:
        proxy.close()
        server.stop()
    assert stats.bytes == TOKENS * layout.bytes_per_token
    assert failures == []


def test_the_kv_fingerprint_tells_weights_and_dtypes_apart():
    layout = KVLayout(2, 2, 16, torch.float32)
    assert kv_fingerprint("weights-a", layout) == kv_fingerprint("weights-a", layout)
    assert kv_fingerprint("weights-a", layout) != kv_fingerprint("weights-b", layout)
    other_dtype = KVLayout(2, 2, 16, torch.bfloat16)
    assert kv_fingerprint("weights-a", layout) != kv_fingerprint("weights-a", other_dtype)
