"""Intake: how EngineWorker takes work from Redis, a mixin of it (worker.py).

Pull only what there is room for (room.py); take each entry: a re-delivery of one
held, a cancel or a deadline met in the queue, an answer already whole, a refusal by
the engine (answered, any handoff's KV released), else a request added to the engine
or a handoff admitted (handoff_flow.py). A handoff parked without room goes back to
the queue after a while, for a decoder that has room.
"""

from __future__ import annotations

import time

import redis

from tandem.engine.chat_template import template_options
from tandem.engine.engine import Engine
from tandem.engine.request import SamplingParams
from tandem.engine.service.handoff_flow import HandoffFlow
from tandem.engine.service.held import Held
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.redis_outage import RedisOutage, unavailable
from tandem.engine.service.redis_writes import RedisWrites
from tandem.engine.service.refusals import CANCELLED, redelivered, refusal_of
from tandem.engine.service.replies import Replies
from tandem.engine.service.room import pull_room
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.work_queue import Delivery
from tandem.protocol import ErrorCode, Handoff, ProtocolError, WorkItem

# A handoff parked this long on a decoder without room goes back to the queue, and the
# decoder pulls nothing for PARK_COOLDOWN_S, so that one with room (a replica started
# for the load, say) takes it; alone, the decoder takes it again after the pause.
PARKED_HAND_BACK_S = 1.0
PARK_COOLDOWN_S = 0.25


class Intake:
    # EngineWorker's state (worker.py says what each holds).
    engine: Engine
    settings: WorkerSettings
    io: RedisIO
    metrics: EngineMetrics
    handoffs: HandoffFlow | None
    held: dict[str, Held]
    replies: Replies
    writes: RedisWrites
    outage: RedisOutage
    _untaken: list[Delivery]
    _to_ack: list[Delivery]
    _draining: bool
    _pull_paused_until: float

    def _pull(self, *, block: bool) -> None:
        room = 0
        if not (self.outage.down or self._untaken):
            # A draining decoder keeps nothing parked: a decoder with room takes it now
            # (waiting here, it waited for this one's room or its drain timeout).
            self._hand_back_parked(0.0 if self._draining else PARKED_HAND_BACK_S)
            parked = self.handoffs.num_parked if self.handoffs is not None else 0
            if not self._draining and time.monotonic() >= self._pull_paused_until:
                room = pull_room(self.engine.scheduler, self.settings, len(self.held), parked)
        if self.outage.down or not (room or self._untaken):
            if block:
                time.sleep(self.settings.idle_block_ms / 1000)
            return
        try:
            if self._draining and self._untaken:
                # Pulled before the drain, as Redis went away: the next engine to pull
                # starts them, not this one on its way out.
                self.io.queue.hand_back(self._untaken)
                self._untaken = []
                return
            if room:
                if not self.io.epoch.noted:
                    # Redis was away at the start: noted before anything is held, or the
                    # check of a request whose entry is lost never passes (run to its
                    # end for nobody once another engine finished it).
                    self.io.epoch.note()
                pulled = self.io.queue.pull(room, self.settings.idle_block_ms if block else 0)
                self._untaken = list(pulled)  # first: Redis may fail below
                if pulled.malformed:
                    self.replies.unreadable(pulled.malformed)
                    # Their answers, then their acks (a failure between leaves them to
                    # be pulled and answered again, not lost with their answers).
                    self.io.responses.flush()
                    self.io.queue.ack_entries(pulled.unreadable)
            took = bool(self._untaken)
            # One at a time, each dropped from _untaken once taken: Redis going away
            # midway leaves the rest to take once it is back (pulled again, they would
            # count one more delivery each).
            while self._untaken:
                self._take(self._untaken[0])
                del self._untaken[0]
                if self._untaken and self.handoffs is not None and self.handoffs.num_parked:
                    # No room for that handoff: the rest go back to the queue at once,
                    # for a decoder that has room (a replica just started, say).
                    self.io.queue.hand_back(self._untaken)
                    self._untaken = []
        except redis.RedisError as exc:
            if not unavailable(exc):
                raise
            self.outage.failed(exc, self.writes.holding(len(self.held)))
            return
        if took:  # the waiting tokens' integral counts them from now, not from the step's end
            self.metrics.observe_queues(self.engine)

    def _hand_back_parked(self, after_s: float) -> None:
        """Handoffs parked past after_s go back to the queue (PARKED_HAND_BACK_S says
        why): one waited on a full decoder for its room while another decoder sat idle,
        until its KV offer expired and it was recomputed."""
        if self.handoffs is None:
            return
        stale = self.handoffs.parked_longer_than(after_s)
        deliveries = [self.held[rid].delivery for rid in stale if rid in self.held]
        if not deliveries:
            return
        try:
            self.io.queue.hand_back(deliveries)
        except redis.RedisError as exc:
            if not unavailable(exc):
                raise
            return  # kept parked: the outage is noticed by the next write
        for rid in stale:
            self.handoffs.drop(self.engine, rid)
            self.held.pop(rid, None)
        self._pull_paused_until = time.monotonic() + PARK_COOLDOWN_S

    def _take(self, delivery: Delivery) -> None:
        self._take_entry(delivery)
        rid, flow, message = delivery.request_id, self.handoffs, delivery.message
        taken = rid in self.held or (flow is not None and flow.fetching(rid))
        if isinstance(message, Handoff) and flow is not None and not taken:
            # Ended or refused as it came (cancelled, past its deadline, answered
            # already, too long for this context...): the prompt engine frees its KV now,
            # not at the offer's expiry (pinned for nobody, and read as busy).
            flow.release(message)

    def _take_entry(self, delivery: Delivery) -> None:
        message = delivery.message
        work = message.work_item if isinstance(message, Handoff) else message
        rid = work.request_id
        if rid in self.held:  # re-delivered to us while we still work on it
            held = self.held[rid]
            old = held.delivery
            if (old.stream, old.entry_id) != (delivery.stream, delivery.entry_id):  # queued again
                if held.pending:  # keep the new entry, acknowledge the old
                    self._to_ack.append(held.delivery)
                held.delivery, held.pending = delivery, True
            return
        if self.handoffs is not None and self.handoffs.offered(rid):
            self.handoffs.withdraw(self.engine, rid)  # its Handoff lost: prefill it anew
        # An ending's offset counts the tokens its stream already holds: a prompt
        # engine's first token, an earlier engine's before a takeover.
        first = message.first_token_ids if isinstance(message, Handoff) else []
        # Every delivery, not only reclaimed ones: a gateway may retry a request id.
        try:
            history = self.io.responses.history(rid)
        except ProtocolError as exc:  # it cannot be resumed without repeating or losing text
            self.replies.fail(delivery, work, ErrorCode.ENGINE_ERROR, str(exc), len(first))
            return
        if history.final is not None:  # it already ended: never run it twice
            final = history.final
            by_prompt = isinstance(message, Handoff) and final.engine_id == message.prompt_engine
            if by_prompt and final.error_code is not None:
                # Its prompt engine ended it while the handoff waited (its client left):
                # counted here, as a decoder counts the end of every handoff it takes (a
                # prompt engine counts `handoff`; counted on both sides, a decoder mid-fetch
                # as the cancel came would count it twice).
                self.metrics.request_ended(str(final.error_code))
            self._to_ack.append(delivery)
            return
        sent_before = max(len(history.token_ids), len(first))
        if delivery.exhausted:
            refusal = redelivered(rid, delivery.times_delivered)
            self.replies.refuse(delivery, work, refusal, offset=sent_before)
            return
        if self.io.is_cancelled(rid):  # cancelled while queued: it ends here, said so
            # (a gateway whose read missed the cancel reads on until a final event)
            self.replies.fail(delivery, work, ErrorCode.CANCELLED, CANCELLED, offset=sent_before)
            return
        if work.deadline is not None and time.time() > work.deadline:
            why = "the deadline passed in queue"
            self.replies.fail(delivery, work, ErrorCode.DEADLINE_EXCEEDED, why, offset=sent_before)
            return
        sent = list(history.token_ids)
        try:
            params = SamplingParams(**work.sampling)
            if isinstance(message, Handoff):
                flow, engine = self.handoffs, self.engine
                cached = flow.take(engine, message, work, params, history, self.metrics)
                self.held[rid] = Held(delivery, work, sent=sent_before, cached_tokens=cached)
                return
            self._add(work, params, sent, history.text)
        except (ValueError, TypeError) as exc:  # the engine's refusals
            self._forget_refused(rid)
            self.replies.refuse(delivery, work, refusal_of(exc), offset=sent_before)
            return
        self.held[rid] = Held(delivery, work, sent=len(sent))

    def _forget_refused(self, rid: str) -> None:
        """Free what a request refused while being taken had reserved (a handoff's
        blocks), lest they stay taken for good."""
        if self.handoffs is not None:
            if self.handoffs.fetching(rid):
                return  # not refused after its fetch started: nothing to write into
            self.handoffs.drop(self.engine, rid)
        self.engine.abort(rid)

    def _add(self, work: WorkItem, params: SamplingParams, sent: list[int], text: str) -> None:
        engine = self.engine
        ids = work.prompt_token_ids
        if work.messages is not None:
            if engine.tokenizer is None:
                raise ValueError("this model has no tokenizer, so no chat template")
            options = template_options(
                work.add_generation_prompt,
                work.continue_final_message,
                work.chat_template_kwargs,
            )
            limit = engine.config.max_model_len
            ids = engine.tokenizer.encode_chat(work.messages, **options, max_model_len=limit)
        engine.add_request(
            work.request_id,
            work.prompt,
            params,
            prompt_token_ids=ids,
            priority=work.priority,
            generated_token_ids=sent,
            generated_text=text,
            exact_max_tokens=work.max_tokens_given,
            cache_salt=work.cache_salt,
        )
