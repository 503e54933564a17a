"""Replies: what a client reads of its request, written to the request's response stream.

Its tokens as the engine makes them, then its finish with the usage, or an error that
names the problem. An outcome queues its work entry's acknowledgement, which RedisWrites
makes once the events are flushed: an entry is acknowledged only once its outcome is
written. The worker decides what to say; this says it, and counts it in the metrics.
"""

from __future__ import annotations

import logging
import time

from tandem.engine.engine_output import EngineOutput
from tandem.engine.service.held import Held
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.refusals import Refusal
from tandem.engine.service.wire_logprobs import listed_logprobs, wire_logprobs
from tandem.engine.service.work_queue import Delivery
from tandem.engine.tokenizer import Tokenizer
from tandem.protocol import ErrorCode, ResponseEvent, Usage, WorkItem

log = logging.getLogger(__name__)


class Replies:
    def __init__(
        self,
        io: RedisIO,
        metrics: EngineMetrics,
        engine_id: str,
        to_ack: list[Delivery],
        tokenizer: Tokenizer | None,
    ) -> None:
        self.io = io
        self.metrics = metrics
        self.engine_id = engine_id
        self.to_ack = to_ack  # RedisWrites' list: acknowledged after the flush
        self.tokenizer = tokenizer

    def tokens(self, held: Held, out: EngineOutput) -> None:
        """The tokens a step made for the request."""
        offset = out.num_output_tokens - len(out.new_token_ids)
        logprobs = None
        if out.logprobs is not None:
            listed = listed_logprobs(out, self.tokenizer)
            logprobs = wire_logprobs(listed, self.tokenizer) if listed else None
        event = ResponseEvent.tokens(
            offset, out.new_token_ids, out.text_delta, self.engine_id, logprobs
        )
        self.io.responses.add(out.request_id, event)
        held.written = out.num_output_tokens
        if held.first_token_at is None:
            held.first_token_at = time.time()
            if offset == 0:  # this engine produced the request's first token
                # From the gateway's clock: a node's clock behind it would observe less
                # than nothing (a histogram's _sum pulled down by it).
                self.metrics.ttft.observe(max(0.0, held.first_token_at - held.work.created_at))

    def finish(self, held: Held, out: EngineOutput) -> None:
        """The request ended (a stop, its length): its usage, and its entry acknowledged."""
        cached = max(out.num_cached_tokens, held.cached_tokens)
        usage = Usage(out.num_prompt_tokens, out.num_output_tokens, cached)
        event = ResponseEvent.finish(
            out.num_output_tokens, out.finish_reason, usage, self.engine_id
        )
        self.io.responses.add(out.request_id, event)
        generated = out.num_output_tokens - held.sent
        if held.first_token_at is not None and generated > 1:
            span = time.time() - held.first_token_at
            self.metrics.tpot.observe(span / (generated - 1))
        self.to_ack.append(held.delivery)
        self.metrics.request_ended(out.finish_reason)
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.generation_tokens.inc(usage.completion_tokens)

    def fail(
        self,
        delivery: Delivery,
        work: WorkItem,
        code: ErrorCode,
        message: str,
        offset: int = 0,
        param: str | None = None,
    ) -> None:
        """End the request with an error (after `offset` tokens), its entry acknowledged."""
        self.error(work.request_id, code, message, offset, param)
        self.to_ack.append(delivery)

    def refuse(self, delivery: Delivery, work: WorkItem, refusal: Refusal, offset: int = 0) -> None:
        """As `fail`, with the refusal's code, message and param."""
        self.fail(delivery, work, refusal.code, refusal.message, offset, refusal.param)

    def error(
        self, rid: str, code: ErrorCode, message: str, offset: int = 0, param: str | None = None
    ) -> None:
        event = ResponseEvent.error(code, message, self.engine_id, offset, param)
        self.io.responses.add(rid, event)
        self.metrics.request_ended(str(code))

    def unreadable(self, malformed: list[tuple[str, str, str | None]]) -> None:
        """Entries no engine can read (a gateway of another protocol version, a hand-made
        entry), acked once this is written: said in the log, and answered where the request id could
        be read, else its client waited out its whole deadline in silence."""
        for _, why, rid in malformed:
            log.warning("unreadable entry dropped: %s", why)
            if rid is not None:
                message = f"the engine cannot read this request: {why}"
                self.error(rid, ErrorCode.INVALID_REQUEST, message)
