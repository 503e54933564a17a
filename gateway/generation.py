"""A Generation: one admitted request, read back from its work items' response streams.

Choices (n > 1: one work item each) are read together and merged by index:
non-streaming answers list them in index order; streams interleave chunks as
tokens arrive, each chunk naming its choice's index. An error on any choice
ends the whole request (the other choices are cancelled), as does the
deadline. `abandon` is the one place work gets cancelled. Work a Redis restart
lost is queued again (recovery.py) and its reading goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from tandem.gateway.admission import Ticket
from tandem.gateway.broker import Broker
from tandem.gateway.cancels import Cancel, Cancels, Queued
from tandem.gateway.directory import ModelDirectory
from tandem.gateway.errors import (
    SERVER,
    GatewayError,
    deadline_exceeded,
    from_engine,
    redis_trouble,
    unavailable,
)
from tandem.gateway.jobs import Job
from tandem.gateway.metrics import GatewayMetrics
from tandem.gateway.prompts import naming_prompt
from tandem.gateway.reader import AsyncResponseReader, DeadlinePassed, ResponseGap
from tandem.gateway.recovery import LossWatch
from tandem.gateway.rendering import ChoiceResult, Renderer, total_usage
from tandem.gateway.streaming import DONE, sse
from tandem.protocol import ErrorCode, EventKind, ProtocolError, ResponseEvent

log = logging.getLogger("tandem.gateway")
# The most a Redis call made on the way to another answer (an error, a deadline) may
# add to it.
_REDIS_ASIDE_S = 1.0
# The ends of one attempt's reading, not of the work: other attempts may still read it
# (one that had read further before Redis lost the stream's tail sees no gap).
_READERS_LEAVE = ("disconnect", "deadline", "response_lost")

Event = tuple[int, ResponseEvent]


class Generation:
    def __init__(
        self,
        job: Job,
        ticket: Ticket,
        renderer: Renderer,
        *,
        reader: AsyncResponseReader,
        broker: Broker,
        cancels: Cancels,
        metrics: GatewayMetrics,
        arrived: float,
        directory: ModelDirectory,
        watch: LossWatch | None = None,
        settle: Callable[[int], Awaitable[None]] | None = None,
        give_back: Callable[[], Awaitable[None]] | None = None,
        leave: Callable[[], Awaitable[None]] | None = None,
        account: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.job = job
        self.ticket = ticket
        self.renderer = renderer
        self.reader = reader
        self.broker = broker
        self.cancels = cancels
        self.metrics = metrics
        # time.perf_counter() at the request's arrival (TTFT is measured from it).
        self.arrived = arrived
        self.deadline = time.monotonic() + job.timeout
        self.choices = [ChoiceResult() for _ in ticket.request_ids]
        self._open = set(range(len(ticket.request_ids)))
        self._abandoned = False
        self._first_token_sent = False
        # The status of the error that ended the stream after it began, if one did.
        self.stream_failed: int | None = None
        self.directory = directory
        # Choices an engine took (it wrote an event): for the deadline's message.
        self._taken: set[int] = set()
        # Queues the work again if Redis loses it (None: not watched).
        self.watch = watch
        # Told the tokens the whole answer used (its usage's total), once every choice
        # finished: the tpm quota's settlement (None: nothing to settle).
        self.settle = settle
        # Returns the quota the request took, where the server's stop cuts it before its
        # client got any of it (None: nothing to give back).
        self.give_back = give_back
        # Gives back the work's place in flight (its key's max_in_flight) as its reading
        # ends, however it ends, unless another attempt reads on (None: it holds none).
        self.leave = leave
        # Set when this attempt stops reading work that goes on for another reader (an
        # Idempotency-Key's): the place is that reader's to give back.
        self._read_on = False
        # Told the usage of the whole answer once every choice finished (the key's
        # metrics of what it was delivered; None: not counted).
        self.account = account

    # ---------------------------------------------------------------- reading

    async def events(self) -> AsyncGenerator[Event, None]:
        """(choice index, event) until every choice ended; GatewayError on an
        engine error, the deadline, or an unreadable or unreachable Redis."""
        first = True
        try:
            async for index, event in self.reader.events(
                self.ticket.request_ids, self.deadline, self.watch
            ):
                if (
                    event.event == EventKind.ERROR
                    and event.error_code == ErrorCode.DEADLINE_EXCEEDED
                ):
                    # The engine saw the deadline first (in its queue, or running): the
                    # gateway's own answer, its likely cause and no retry by the SDKs,
                    # whichever of the two saw it first.
                    raise DeadlinePassed(f"an engine ended choice {index} at its deadline")
                self._taken.add(index)
                if first and not self.ticket.attached and event.event == EventKind.TOKENS:
                    waited = time.monotonic() - self.ticket.enqueued_at
                    self.metrics.enqueue_to_first_token(self.job.model, waited)
                first = False
                if event.is_final:
                    self._open.discard(index)
                if event.event == EventKind.ERROR:
                    await self.abandon("choice_failed")
                    error = from_engine(
                        event.error_code,
                        self._in_batch(index, event.error_message),
                        self.job.prompt_param,
                        event.error_param,
                        self.job.max_tokens_param,
                    )
                    if error.status >= 500:
                        # Worth retrying (n = 1's choice had ended, so abandon released
                        # nothing): a retry with the Idempotency-Key runs it afresh
                        # rather than read this error again for the record's lifetime.
                        await self._forget_record()
                    elif self.ticket.ledger_key is not None:
                        # A refusal is final too: a retry reads it again while its
                        # stream lasts, and past that queues afresh (not waits for
                        # its deadline on a stream gone).
                        await self._answered(self.ticket.ledger_key)
                    raise error
                self._absorb(index, event)
                yield index, event
            if self.ticket.ledger_key is None:  # no retry will read them again
                await self._delivered()
            else:  # a retry reads them again while the streams last, not past them
                await self._answered(self.ticket.ledger_key)
            if all(c.usage is not None for c in self.choices):
                usage = total_usage(self.choices, self.job.choices_per_prompt)
                if self.account is not None:
                    self.account(usage)
                if self.settle is not None:
                    await self.settle(usage["total_tokens"])
        except DeadlinePassed:
            await self.abandon("deadline")
            raise deadline_exceeded(
                f"The request did not finish within its deadline of {self.job.timeout:g} s"
                + await self._stall()
            ) from None
        except ResponseGap as gap:
            # Never an answer with a hole in it: retried, it runs afresh.
            await self.abandon("response_lost")
            await self._forget_record()
            log.warning("%s: %s (Redis lost them)", self.ticket.base_id, gap)
            raise unavailable(
                f"Part of the answer was lost: Redis lost tokens {gap.seen} to "
                f"{gap.offset - 1} before the gateway read them (it restarted without its "
                "data); retry the request",
                code="response_lost",
            ) from None
        except ProtocolError as exc:
            await self.abandon("protocol_error")
            raise GatewayError(
                500, f"Unreadable response from an engine: {exc}", type=SERVER, code="protocol"
            ) from None
        except (RedisError, OSError) as exc:
            ids = ", ".join(self.ticket.request_ids)
            log.warning("ending %s with 503: Redis stayed unreachable while reading: %s", ids, exc)
            # Told it failed, its client retries as a new request: the engines must
            # not run this one too once Redis is back (the cancel is written then). A
            # retry with the same Idempotency-Key attaches to it instead: this attempt
            # only stops reading, and the work is cancelled if no other reads it (left
            # running, it held an engine until its deadline for nobody).
            await self.abandon("redis_unreachable", last_only=self.ticket.ledger_key is not None)
            lost = f"Lost the connection to Redis while reading: {redis_trouble(exc)}"
            raise unavailable(lost) from None
        finally:
            await self._leave()

    async def _leave(self) -> None:
        """Give back the work's place in flight, once, unless another attempt reads on:
        on a task of its own, so that the answer or its error goes out without waiting
        on Redis (a paused one held a stream's error event past its grace)."""
        if self.leave is not None and not self._read_on:
            leave, self.leave = self.leave, None
            self.cancels.on_the_way_out(self._aside(leave()))

    def _in_batch(self, index: int, message: str | None) -> str | None:
        """An engine's words on choice `index`, naming its prompt in a completions batch
        (as the gateway's own context check does)."""
        if message is None:
            return None
        return naming_prompt(message, index // self.job.choices_per_prompt, self.job.prompts)

    async def _forget_record(self) -> None:
        if self.ticket.ledger_key is not None:
            ledger = self.cancels.ledger
            await self._aside(ledger.release(self.ticket.ledger_key, self.ticket.base_id))

    async def _aside(self, call: Awaitable[object]) -> None:
        """A Redis call on the way to the answer: at most _REDIS_ASIDE_S, never raises."""
        try:
            async with asyncio.timeout(_REDIS_ASIDE_S):
                await call
        except (RedisError, OSError) as exc:  # TimeoutError is an OSError
            log.debug("%s: Redis did not take %r: %s", self.ticket.base_id, call, exc)

    async def _answered(self, ledger_key: str) -> None:
        """The answer is whole: every choice's stream lasts its full TTL from now, and the
        Idempotency-Key's record less (a choice that ended 30 s before the last expired
        before the record, and a retry attached to it waited out its deadline)."""
        await self._aside(self.broker.kept(self.ticket.request_ids))
        await self._aside(self.cancels.ledger.answered(ledger_key, self.ticket.base_id))

    async def _delivered(self) -> None:
        # Bounded as every call on the way to the answer is: a Redis stalled then (a
        # fork, a slow fsync) held a whole answer 5 s, and cut a stream at its deadline.
        # Not taken, the streams expire at their full TTL.
        await self._aside(self.broker.delivered(self.ticket.request_ids))

    async def _stall(self) -> str:
        """The likely cause of a deadline, from the directory's (cached) registry."""
        try:
            taken = self._open <= self._taken
            async with asyncio.timeout(_REDIS_ASIDE_S):
                return await self.directory.stall(self.job.model, taken=taken)
        except (RedisError, OSError):  # TimeoutError is an OSError
            return ""

    def _absorb(self, index: int, event: ResponseEvent) -> None:
        choice = self.choices[index]
        if event.event == EventKind.TOKENS and not self.job.stream:
            # A stream sends each event as it comes and ends on the usage alone: kept,
            # its text and logprobs held hundreds of MB of a long answer's to its end.
            choice.parts.append(event.text)
            choice.logprobs.extend(event.logprobs or [])
        elif event.event == EventKind.FINISH:
            choice.finish_reason = event.finish_reason
            choice.usage = event.usage

    # --------------------------------------------------------------- answers

    async def complete(self) -> dict:
        """The whole answer, once every choice ended."""
        async for _ in self.events():
            pass
        return self.renderer.response(self.choices)

    async def stream(
        self, first: Event, rest: AsyncGenerator[Event, None]
    ) -> AsyncGenerator[bytes, None]:
        """SSE chunks: the first event (already read), then the rest. An error after
        the stream started ends it with an error chunk (the SDKs raise on it)."""
        renderer = self.renderer
        try:
            for chunk in renderer.opening(len(self.choices)):
                yield sse(chunk)
            for chunk in self._chunks(*first):
                yield chunk
            async for index, event in rest:
                for chunk in self._chunks(index, event):
                    yield chunk
            if renderer.include_usage:
                yield sse(renderer.usage(self.choices))
            yield DONE
        except GatewayError as error:
            self.stream_failed = error.status
            yield sse(error.body())
        finally:
            await rest.aclose()

    def _chunks(self, index: int, event: ResponseEvent) -> list[bytes]:
        if event.event == EventKind.TOKENS and (event.text or event.logprobs):
            if not self._first_token_sent:
                self._first_token_sent = True
                self.metrics.first_token(self.job.model, time.perf_counter() - self.arrived)
            return [sse(self.renderer.text(index, event.text, event.logprobs))]
        if event.event == EventKind.FINISH:
            return [sse(self.renderer.finish(index, event.finish_reason or "stop"))]
        return []

    # ------------------------------------------------------------ cancelling

    async def client_gone(self) -> None:
        """The HTTP client left: cancel what still runs (see disconnect.py)."""
        await self.abandon("disconnect")
        await self._leave()  # its reading may not have begun: no end of it would

    def server_stopping(self) -> None:
        """The server shuts down under this attempt. Work with an Idempotency-Key stays
        queued for a retry through another replica to attach to (disconnect.py); this
        attempt reads it no more. Work without one is cancelled: no retry can attach to
        it (its client retries as a new request), and left queued it ran for nobody."""
        key = self.ticket.ledger_key
        if self._abandoned or not self._open:
            return
        self._abandoned = True
        if key is not None:
            self._read_on = True  # left queued for a retry to attach to, and give back
            self.cancels.step_aside(key, self.ticket.base_id, self.job.base_id)
            return
        ids = self._open_ids()
        cancel = Cancel(self.ticket.base_id, ids, "server_stop", None, queued=self._queued())
        self.cancels.cancel_soon(cancel)
        if self.give_back is not None and not self._first_token_sent:
            # Its client retries as a new request (a 503 shutting_down, which the SDKs
            # retry), charged afresh: a low-rpm key's retry met a 429.
            self.cancels.on_the_way_out(self.give_back())

    async def deadline_passed(self) -> None:
        """The deadline passed while the answer could not go out (see streaming.py)."""
        await self.abandon("deadline")

    async def abandon(self, why: str, *, last_only: bool = False) -> None:
        """Cancel the choices still running (the engine frees their KV), once; work
        other attempts read too (an Idempotency-Key's) only if none is left.

        Never raises, and waits on Redis _REDIS_ASIDE_S at most: it runs while
        answering something else (an error, a disconnect), and a Redis outage must
        not hide or delay that answer. A cancel Redis does not take then is kept and
        written once it answers (cancels.py).
        """
        if self._abandoned or not self._open:
            return
        self._abandoned = True
        ids = self._open_ids()
        key = self.ticket.ledger_key
        queued = self._queued()
        if last_only:  # Redis away: leaving and cancelling wait for it, together
            shared = Cancel(
                self.ticket.base_id, ids, why, key, if_last_of=self.job.base_id, queued=queued
            )
            await self.cancels.cancel(shared, _REDIS_ASIDE_S)
            return
        started = time.monotonic()
        leaving = None
        if key is not None and why in _READERS_LEAVE:
            me = self.job.base_id
            others = await self.cancels.leave(key, self.ticket.base_id, me, _REDIS_ASIDE_S)
            if others:
                log.info(
                    "%s (%s): %d other attempts still read it", self.ticket.base_id, why, others
                )
                self._read_on = True
                return
            if others is None:
                # Whether another attempt reads it is unknown until Redis answers: the
                # cancel waits for that, and is written only if none does (it cancelled
                # as if alone, and another attempt's client read "cancelled"). Its
                # entries stay for an engine to end with a `cancelled` event.
                leaving, queued = me, None
        left = max(0.0, _REDIS_ASIDE_S - (time.monotonic() - started))
        cancel = Cancel(self.ticket.base_id, ids, why, key, if_last_of=leaving, queued=queued)
        await self.cancels.cancel(cancel, left)

    def _open_ids(self) -> tuple[str, ...]:
        """The request ids of the choices still running."""
        return tuple(self.ticket.request_ids[i] for i in sorted(self._open))

    def _queued(self) -> Queued | None:
        """Where the open choices' work entries were queued (unknown when attached):
        as the loss watch last queued them, if Redis lost them and it queued them again."""
        known = self.watch.entry_ids if self.watch is not None else self.ticket.entry_ids
        entries = tuple(known[i] for i in sorted(self._open) if i < len(known) and known[i])
        if not entries:
            return None
        first = self.job.items[0]
        return Queued(first.model, first.priority, entries)
