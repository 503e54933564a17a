"""Both ends of a KV handoff, as the engine loop sees them.

PROMPT side, `PinnedOffers`: the KV of prefilled requests, offered to
decoders until fetched or expired. The KV server thread looks offers up; the
main thread adds and removes them.

COMPLETION side, `KVFetches`: fetches running on a small thread pool; their
outcomes come back to the main thread, which alone touches the scheduler.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from tandem.engine.service.kv_transfer import KVTransferError, PinnedKV, Reason, TransferStats


def token_slots(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions 0..num_tokens-1 of a sequence."""
    positions = torch.arange(num_tokens)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


class PinnedOffers:
    """Thread-safe: request id -> (pinned KV, unix expiry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: dict[str, tuple[PinnedKV, float]] = {}

    def add(self, pinned: PinnedKV, expires_at: float) -> None:
        with self._lock:
            self._offers[pinned.handle] = (pinned, expires_at)

    def lookup(self, handle: str) -> PinnedKV | None:
        """For the KV server thread: the offer, if it is still valid."""
        with self._lock:
            offer = self._offers.get(handle)
        if offer is None or offer[1] < time.time():
            return None
        return offer[0]

    def remove(self, handle: str) -> bool:
        with self._lock:
            return self._offers.pop(handle, None) is not None

    def expired(self, now: float) -> list[str]:
        with self._lock:
            return [h for h, (_, expiry) in self._offers.items() if expiry < now]

    def handles(self) -> list[str]:
        with self._lock:
            return list(self._offers)

    def __len__(self) -> int:
        with self._lock:
            return len(self._offers)

    def __contains__(self, handle: object) -> bool:
        with self._lock:
            return handle in self._offers


@dataclass(frozen=True)
class FetchOutcome:
    request_id: str
    stats: TransferStats | None  # set on success
    error: KVTransferError | None  # set on failure


# A prompt engine that did not answer a fetch in time is skipped (its prompts
# recomputed) this long: a stalled one held a fetch thread for the whole timeout with
# each of its handoffs, and the handoffs of healthy ones waited in line behind them.
# One whose frames stopped midway answered: a slow link, not a stalled peer.
SUSPECT_FOR_S = 30.0
# Meanwhile one fetch is let through after this long, then twice as long after each
# that went unanswered, and one suspect at a time is probed (a probe of a stalled peer
# holds a fetch thread for a whole timeout). One the peer answers ends the suspicion:
# a prompt engine that was only busy (its transfer threads all taken, the fetch waiting
# in its queue past the timeout) was skipped for the whole 30 s, and the offers skipped
# stayed pinned there until they expired, so it filled up and pulled no more work.
PROBE_EVERY_S = 5.0
# Failures that are an answer from the peer: it is up, if not with this KV.
_ANSWERS = frozenset(
    {Reason.REFUSED, Reason.MISMATCH, Reason.CHECKSUM, Reason.PROTOCOL, Reason.TIMEOUT}
)
# Offers skipped while a peer is suspect, kept to release once it answers again.
_SKIPPED_KEPT = 64
# A release waits this long at most for the prompt engine (it holds a fetch thread).
RELEASE_WITHIN_S = 2.0
# Failed fetches after which the prompt engine likely still holds the offer (the
# transfer broke, not the offer): released, so it frees the KV now.
_OFFER_LEFT_PINNED = frozenset(
    {Reason.TIMEOUT, Reason.CHECKSUM, Reason.PROTOCOL, Reason.UNREACHABLE}
)


@dataclass
class _Suspect:
    """A peer that did not answer a fetch: skipped until `until`, but for a probe fetch
    from `probe_at` on (all time.monotonic())."""

    until: float
    probe_at: float
    failed_probes: int = 0  # in a row: each doubles the wait for the next
    skipped: dict[str, str] = field(default_factory=dict)  # offer handle -> its token


class KVFetches:
    """Runs fetches off the main thread; outcomes are collected with `done()`."""

    def __init__(
        self,
        fetch: Callable[..., TransferStats],
        max_parallel: int = 2,
        release: Callable[..., bool] | None = None,
        probe_every_s: float = PROBE_EVERY_S,
        news: threading.Event | None = None,
    ) -> None:
        self._fetch = fetch
        self._news = news  # set as each outcome is queued: the engine may wait on it
        self._release = release
        self._pool = ThreadPoolExecutor(max_parallel, thread_name_prefix="kv-fetch")
        self._outcomes: queue.SimpleQueue[FetchOutcome] = queue.SimpleQueue()
        # Requests whose fetch is in flight: their blocks must not be freed yet,
        # or a fetch would write into blocks another request now owns.
        self.in_flight: set[str] = set()
        self._probe_every_s = probe_every_s
        # Addresses that did not answer a fetch, and the offers skipped meanwhile.
        self._suspects: dict[str, _Suspect] = {}
        self._probing = False  # a probe runs (of any suspect)
        self._suspects_lock = threading.Lock()

    def start(self, request_id: str, **fetch_args: object) -> None:
        self.in_flight.add(request_id)
        self._pool.submit(self._run, request_id, fetch_args)

    def release(self, address: str, *, handle: str, token: str) -> None:
        """Free an offer this engine will not fetch, on a fetch thread; best effort."""
        if self._release is None:
            return
        with self._suspects_lock:
            suspect = self._suspects.get(address)
            if suspect is not None and suspect.until > time.monotonic():
                # It answers nothing now: released if it answers again, else they expire.
                suspect.skipped[handle] = token
                while len(suspect.skipped) > _SKIPPED_KEPT:
                    del suspect.skipped[next(iter(suspect.skipped))]
                return
        args = {"address": address, "handle": handle, "token": token}
        with contextlib.suppress(RuntimeError):  # closing: the offer expires on its own
            self._pool.submit(self._release, **args, timeout=RELEASE_WITHIN_S)

    def _run(self, request_id: str, fetch_args: dict[str, object]) -> None:
        try:
            self._fetch_one(request_id, fetch_args)
        finally:
            if self._news is not None:
                self._news.set()

    def _fetch_one(self, request_id: str, fetch_args: dict[str, object]) -> None:
        address = str(fetch_args.get("address"))
        probe = False
        try:
            probe = self._check(address)
            stats = self._fetch(**fetch_args)
            self._outcomes.put(FetchOutcome(request_id, stats, None))
            if probe:
                self._answered(address)
        except KVTransferError as exc:
            if exc.reason is Reason.TIMEOUT and exc.unanswered:
                # Its offer too is released once the peer answers again (only those
                # skipped were: this one stayed pinned for nobody until its TTL).
                handle, token = fetch_args.get("handle"), fetch_args.get("token")
                offer = None if handle is None else (str(handle), str(token))
                self._suspect(address, probe, offer)
            elif probe and exc.reason in _ANSWERS:  # it answered, if not with the KV
                self._answered(address)
            elif probe:  # unreachable: gone (a new pod has another address)
                self._gone(address)
            self._outcomes.put(FetchOutcome(request_id, None, exc))
            skipped = exc.reason is Reason.SKIPPED
            if skipped or (exc.reason in _OFFER_LEFT_PINNED and not exc.unanswered):
                # The prompt is recomputed here: the offer would stay pinned for nobody
                # (one skipped is released once its engine answers again).
                self.release(address, handle=fetch_args["handle"], token=fetch_args["token"])
        except Exception as exc:  # a bug must not strand the request: recompute it
            error = KVTransferError("protocol", f"{type(exc).__name__}: {exc}")
            self._outcomes.put(FetchOutcome(request_id, None, error))
            if probe:
                self._gone(address)

    def _suspect(self, address: str, probe: bool, offer: tuple[str, str] | None) -> None:
        """The peer did not answer a fetch (a probe, if `probe`) of `offer` (handle,
        token) within its timeout: the offer is released once it answers again."""
        with self._suspects_lock:
            now = time.monotonic()
            suspect = self._suspects.setdefault(address, _Suspect(now, now))
            if offer is not None:
                suspect.skipped[offer[0]] = offer[1]
                while len(suspect.skipped) > _SKIPPED_KEPT:
                    del suspect.skipped[next(iter(suspect.skipped))]
            suspect.until = now + SUSPECT_FOR_S
            if probe:
                suspect.failed_probes += 1
                self._probing = False
            wait = self._probe_every_s * 2**suspect.failed_probes
            suspect.probe_at = now + min(wait, SUSPECT_FOR_S)

    def _gone(self, address: str) -> None:
        """A probe found no one there: still skipped, its skipped offers forgotten
        (released to nobody, each held a fetch thread until its own timeout)."""
        with self._suspects_lock:
            self._probing = False
            if (suspect := self._suspects.get(address)) is not None:
                suspect.skipped.clear()
                suspect.probe_at = time.monotonic() + SUSPECT_FOR_S

    def _check(self, address: str) -> bool:
        """Whether this fetch probes a suspect peer; KVTransferError (skipped) for one
        that timed out moments ago, unless a probe is due."""
        now = time.monotonic()
        with self._suspects_lock:
            suspect = self._suspects.get(address)
            if suspect is None or suspect.until <= now:
                # Its offers skipped then have expired (--handoff-ttl is the same 30 s).
                self._suspects.pop(address, None)
                return False
            if not self._probing and suspect.probe_at <= now:
                self._probing = True
                return True
            ago = now - (suspect.until - SUSPECT_FOR_S)
        raise KVTransferError(Reason.SKIPPED, f"{address} timed out {ago:.0f} s ago")

    def _answered(self, address: str) -> None:
        """A suspect peer answered a probe: asked again from now on, and the offers
        skipped meanwhile are released (they stayed pinned there for nobody)."""
        with self._suspects_lock:
            suspect = self._suspects.pop(address, None)
            self._probing = False
        for handle, token in (suspect.skipped if suspect is not None else {}).items():
            self.release(address, handle=handle, token=token)

    def done(self) -> list[FetchOutcome]:
        outcomes = []
        while True:
            try:
                outcome = self._outcomes.get_nowait()
            except queue.Empty:
                return outcomes
            self.in_flight.discard(outcome.request_id)
            outcomes.append(outcome)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
