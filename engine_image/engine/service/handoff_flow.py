"""HandoffFlow: moving a prefilled request from a PROMPT engine to a COMPLETION engine.

PROMPT side: after prefill the request's KV stays pinned and is offered (a
Handoff on the handoff stream, the KV on this engine's KV server) until a
decoder fetches it or the offer expires.

COMPLETION side: a handoff is admitted (blocks reserved), its KV fetched on a
background thread, and the request decodes once the KV is in. If the fetch
fails (peer gone, fingerprint or size mismatch, timeout), the request is
recomputed here instead: slower, never lost, never hung.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import secrets
import threading
import time

import torch

from tandem.engine.engine import Engine
from tandem.engine.engine_output import EngineOutput
from tandem.engine.request import SamplingParams
from tandem.engine.service.kv_handoff import KVFetches, PinnedOffers, token_slots
from tandem.engine.service.kv_tcp import fetch_kv, release_kv
from tandem.engine.service.kv_transfer import KVLayout, PinnedKV
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.refusals import OtherModelError
from tandem.engine.service.responses import ResponseHistory
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.work_queue import Delivery
from tandem.protocol import ErrorCode, Handoff, ResponseEvent, Role, WorkItem

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Taken:
    """A handoff this COMPLETION engine took, as it is admitted (or waits for room)."""

    handoff: Handoff
    params: SamplingParams
    # Tokens generated before this engine (the prompt engine's, or a dead decoder's).
    generated: list[int]
    # What their events carried: the client has exactly this text.
    sent_text: str
    # The client gave max_tokens: refused if the context cannot hold it here.
    exact_max_tokens: bool
    # The prefix cache's salt (WorkItem.cache_salt).
    cache_salt: str | None


# How far apart the engines' wall clocks may be (NTP keeps them within milliseconds).
# A decoder's clock S seconds ahead shortened every offer by S, and from the handoff
# TTL on (30 s), recomputed every handoff as "expired" without a word.
CLOCK_SKEW_S = 5.0


class HandoffFlow:
    def __init__(
        self,
        settings: WorkerSettings,
        kv_caches: list[torch.Tensor],
        layout: KVLayout,
        block_size: int,
    ) -> None:
        if settings.role is Role.PROMPT and settings.kv_address is None:
            raise ValueError("a PROMPT engine offers KV from its KV server: give its kv_address")
        self.settings = settings
        self.kv_caches = kv_caches
        self.layout = layout
        self.block_size = block_size
        # PROMPT side.
        # Set by the threads as they report (a fetch served, a fetch done): what an
        # engine that can run nothing until then waits on (wait_for_news).
        self._news = threading.Event()
        self.offers = PinnedOffers()
        self.fetched: queue.SimpleQueue[str] = queue.SimpleQueue()  # from the KV server
        # Each with the work entry it came from, acknowledged as it is published.
        self._to_publish: list[tuple[Handoff, Delivery]] = []
        # Offers whose handoff was not published (another engine holds the request now).
        self._unpublished: list[str] = []
        # COMPLETION side.
        self.fetches = KVFetches(fetch_kv, release=release_kv, news=self._news)
        self._waiting_room: list[_Taken] = []
        self._parked_since: dict[str, float] = {}  # request id -> time.monotonic()
        self._mismatched: set[str] = set()  # prompt engines of another model, warned of

    @property
    def num_parked(self) -> int:
        """COMPLETION: handoffs taken that wait for room to admit their KV."""
        return len(self._waiting_room)

    def parked_longer_than(self, seconds: float) -> list[str]:
        """COMPLETION: the request ids of handoffs parked for more than `seconds`."""
        now = time.monotonic()
        return [rid for rid, since in self._parked_since.items() if now - since > seconds]

    @property
    def num_offers(self) -> int:
        return len(self.offers)

    # ---------------------------------------------------------- PROMPT side

    def offer(self, engine: Engine, work: WorkItem, out: EngineOutput, source: Delivery) -> None:
        """Pin the prefilled KV and queue its Handoff (published after the flush, when its
        work entry `source` is acknowledged)."""
        request = engine.scheduler.handoff[out.request_id]
        num_kv = request.num_computed_tokens  # every token but the newest sampled one
        slots = token_slots(request.block_ids, num_kv, self.block_size)
        expires_at = time.time() + self.settings.handoff_ttl
        token = secrets.token_urlsafe(16)  # travels only in the Handoff, through Redis
        fingerprint = self.settings.fingerprint
        self.offers.add(PinnedKV(out.request_id, slots, fingerprint, token), expires_at)
        self._to_publish.append(
            (
                Handoff(
                    work=dataclasses.asdict(work),
                    prompt_token_ids=request.prompt_token_ids,
                    first_token_ids=request.output_token_ids,
                    kv_address=self.settings.kv_address,
                    kv_handle=out.request_id,
                    kv_token=token,
                    num_kv_tokens=num_kv,
                    fingerprint=fingerprint,
                    prompt_engine=self.settings.engine_id,
                    expires_at=expires_at,
                    num_cached_tokens=out.num_cached_tokens,
                ),
                source,
            )
        )

    def publishing(self) -> list[Delivery]:
        """The work entries of handoffs not yet published: kept alive as held ones are."""
        return [source for _, source in self._to_publish]

    def publish_pending(self, io: RedisIO) -> None:
        # Each dropped once written: Redis going away midway keeps the rest (a retry
        # whose first try was written publishes nothing twice, and keeps its offer).
        while self._to_publish:
            handoff, source = self._to_publish[0]
            by_priority = io.decoders_read_priorities()
            if not io.queue.publish_handoff(handoff, source, by_priority=by_priority):
                log.info("handoff of %s not published: another engine has it", handoff.kv_handle)
                self._unpublished.append(handoff.kv_handle)
            del self._to_publish[0]

    def on_fetched(self, handle: str) -> None:
        """Called by the KV server thread after a decoder confirmed the KV."""
        self.fetched.put(handle)
        self._news.set()

    def wait_for_news(self, timeout: float) -> None:
        """Until a thread reports (its report is for `absorb`), `timeout` seconds at most."""
        self._news.wait(timeout)
        self._news.clear()  # a report after this sets it again; absorb reads them all

    def expire_offers(self, engine: Engine, now: float) -> None:
        for handle in self.offers.expired(now):
            self.withdraw(engine, handle)

    def offered(self, request_id: str) -> bool:
        """Whether this engine holds the request's prefilled KV for a decoder."""
        return request_id in self.offers

    def offered_ids(self) -> list[str]:
        return self.offers.handles()

    def withdraw(self, engine: Engine, request_id: str) -> None:
        """Unpin an offer and free its KV (a fetch in flight fails and recomputes)."""
        if self.offers.remove(request_id):
            engine.release_handoff(request_id)

    def withdraw_cancelled(self, engine: Engine, request_id: str, io: RedisIO, why: str) -> None:
        """Its client left: withdraw the offer, and end its stream (a gateway whose
        read missed the cancel reads on until a final event)."""
        request = engine.scheduler.handoff.get(request_id)
        sent = request.num_output_tokens if request is not None else 0
        self.withdraw(engine, request_id)
        event = ResponseEvent.error(ErrorCode.CANCELLED, why, self.settings.engine_id, sent)
        io.responses.add(request_id, event)

    # ------------------------------------------------------ COMPLETION side

    def take(
        self,
        engine: Engine,
        handoff: Handoff,
        work: WorkItem,
        params: SamplingParams,
        history: ResponseHistory,
        metrics: EngineMetrics,
    ) -> int:
        """Admit a handoff and start fetching its KV; returns the prompt's cached tokens.

        Raises admission's errors for a request this engine can never hold (a
        smaller context than the prompt engine's): it would wait for room forever.
        """
        sent = history.token_ids
        generated = sent if len(sent) > len(handoff.first_token_ids) else handoff.first_token_ids
        taken = _Taken(
            handoff, params, list(generated), history.text, work.max_tokens_given, work.cache_salt
        )
        vocab = engine.config.vocab_size
        foreign = [t for t in generated if vocab is not None and t >= vocab]
        if foreign and handoff.fingerprint != self.settings.fingerprint:
            # Another model's tokens (a rollout that changed the vocabulary): this one
            # cannot go on from them, nor recompute what the client already has.
            self._mismatched_engine(handoff.prompt_engine)
            metrics.kv_transfer_failed("mismatch")
            self.release(handoff)
            raise OtherModelError(
                f"the prompt engine {handoff.prompt_engine} serves another model under this "
                f"name: its token id {foreign[0]} is outside this model's vocabulary ({vocab})"
            )
        engine.check_handoff_fits(handoff.prompt_token_ids, params, taken.exact_max_tokens)
        if engine.already_ended(handoff.prompt_token_ids, taken.generated, params):
            # A decoder died after its last token, before its final event; or this
            # engine's context ends where the prompt engine's first token did: the
            # request finishes here without its KV.
            self.release(handoff)
            engine.add_request(
                work.request_id,
                None,
                params,
                prompt_token_ids=handoff.prompt_token_ids,
                generated_token_ids=taken.generated,
                generated_text=history.text,
                cache_salt=work.cache_salt,
            )
            return handoff.num_cached_tokens
        self._admit(engine, taken, metrics)
        return handoff.num_cached_tokens

    def _admit(self, engine: Engine, taken: _Taken, metrics: EngineMetrics) -> bool:
        handoff, generated = taken.handoff, taken.generated
        rid = handoff.work["request_id"]
        table = engine.admit_handoff(
            rid,
            handoff.prompt_token_ids,
            generated,
            taken.params,
            taken.sent_text,
            cache_salt=taken.cache_salt,
        )
        if table is None:  # no room yet: retry every turn, the entry stays ours
            self._waiting_room.append(taken)
            self._parked_since.setdefault(rid, time.monotonic())
            return False
        self._parked_since.pop(rid, None)
        reason = self._recompute_reason(handoff, generated)
        if reason is not None:
            if reason == "mismatch":
                self._mismatched_engine(handoff.prompt_engine)
            else:  # said, as a fetch that failed is (only /metrics told of these)
                log.info("KV of %s not fetched (%s), recomputing", rid, reason)
            metrics.kv_transfer_failed(reason)
            engine.handoff_failed(rid)
            if reason == "mismatch":  # pinned there for nobody until its expiry otherwise
                self.release(handoff)
            return True
        self.fetches.start(
            rid,
            address=handoff.kv_address,
            handle=handoff.kv_handle,
            token=handoff.kv_token,
            fingerprint=handoff.fingerprint,
            num_tokens=handoff.num_kv_tokens,
            dest_slots=token_slots(table, handoff.num_kv_tokens, self.block_size),
            kv_caches=self.kv_caches,
            layout=self.layout,
            timeout=self.settings.kv_fetch_timeout,
        )
        return True

    def _mismatched_engine(self, prompt_engine: str) -> None:
        if prompt_engine not in self._mismatched:
            self._mismatched.add(prompt_engine)  # said once per prompt engine
            log.warning(
                "prompt engine %s serves another model (weights, dtype or KV layout) "
                "under this served name: its prompts are recomputed here (or end, where "
                "its tokens are outside this model's vocabulary)",
                prompt_engine,
            )

    def release(self, handoff: Handoff) -> None:
        """Tell the prompt engine its offer will not be fetched (this engine ends or
        recomputes the request): it frees the KV now, not at the offer's expiry."""
        self.fetches.release(handoff.kv_address, handle=handoff.kv_handle, token=handoff.kv_token)

    def _recompute_reason(self, handoff: Handoff, generated: list[int]) -> str | None:
        if handoff.fingerprint != self.settings.fingerprint:
            return "mismatch"
        if len(generated) != len(handoff.first_token_ids):
            return "stale"  # an earlier decoder got further; its KV is gone
        # The prompt engine's clock set expires_at; the decoder's reads it. Past it by
        # more than clocks drift apart, the offer is surely gone: no fetch is tried.
        # Within that, the prompt engine's refusal of an expired handle decides.
        if time.time() > handoff.expires_at + CLOCK_SKEW_S:
            return "expired"
        return None

    def fetching(self, request_id: str) -> bool:
        return request_id in self.fetches.in_flight

    def drop(self, engine: Engine, request_id: str, *, ending: bool = False) -> None:
        """Forget a request's handoff (cancelled, or another engine owns it now): one
        not yet published, its offer, or one waiting for room. `ending`: the request
        ends here (cancelled, past its deadline), so the prompt engine's offer of one
        waiting for room is released now, not held for nobody until it expires;
        another engine's request is left to it."""
        self._to_publish = [p for p in self._to_publish if p[0].kv_handle != request_id]
        self.withdraw(engine, request_id)
        room = self._waiting_room
        waiting = [w for w in room if w.handoff.work["request_id"] == request_id]
        self._waiting_room = [w for w in room if w.handoff.work["request_id"] != request_id]
        if ending:
            for parked in waiting:
                self.release(parked.handoff)
        self._parked_since.pop(request_id, None)

    # ---------------------------------------------------------------- both

    def absorb(self, engine: Engine, metrics: EngineMetrics) -> list[str]:
        """Apply what the threads reported; returns the requests whose fetch ended."""
        while True:
            try:
                handle = self.fetched.get_nowait()
            except queue.Empty:
                break
            if self.offers.remove(handle):
                engine.release_handoff(handle)
        unpublished, self._unpublished = self._unpublished, []
        for handle in unpublished:  # nobody will fetch it
            self.withdraw(engine, handle)
        results = []
        for outcome in self.fetches.done():
            if outcome.stats is not None:
                engine.handoff_received(outcome.request_id)
                metrics.kv_transfer_bytes.inc(outcome.stats.bytes)
                metrics.kv_transfer_seconds.observe(outcome.stats.seconds)
            else:
                log.info("KV of %s not fetched, recomputing: %s", outcome.request_id, outcome.error)
                metrics.kv_transfer_failed(outcome.error.reason)
                engine.handoff_failed(outcome.request_id)
            results.append(outcome.request_id)
        waiting, self._waiting_room = self._waiting_room, []
        for taken in waiting:
            self._admit(engine, taken, metrics)
        return results

    def close(self) -> None:
        self.fetches.close()
