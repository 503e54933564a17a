"""EngineWorker: the engine's main loop as a service.

Each turn of the loop:
  1. apply what other threads reported (cancellations, KV fetches, KV fetched);
  2. end requests past their deadline, free KV offers nobody fetched;
  3. pull work from Redis, only as much as there is room for (worker_intake.py);
  4. run one engine step and turn its outputs into response events (replies.py);
  5. every few seconds: keep held entries alive (dropping those another engine
     took while this one stalled), heartbeat the registry (heartbeat.py);
  6. flush the events, publish handoffs, then acknowledge what is now durable.

While Redis is away or refuses writes (redis_outage.py) steps 1, 2 and 4 go on
without it: no new work, the events wait in order; the rest resume once it takes writes.
Rules it keeps (docs/engine-service.md): an entry is acknowledged only once its
outcome is written (finished, failed with a clear error, or handed off); an entry
another engine left behind is resumed after the tokens and text the client has;
SIGTERM stops the pulling, lets running requests finish, hands back what is left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tandem.engine.engine import Engine
from tandem.engine.engine_output import EngineOutput, FinishReason
from tandem.engine.service.handoff_flow import HandoffFlow
from tandem.engine.service.heartbeat import Heartbeat
from tandem.engine.service.held import Held
from tandem.engine.service.metrics import EngineMetrics
from tandem.engine.service.redis_io import RedisIO
from tandem.engine.service.redis_writes import RedisWrites
from tandem.engine.service.refusals import CANCELLED
from tandem.engine.service.replies import Replies
from tandem.engine.service.settings import WorkerSettings
from tandem.engine.service.work_queue import Delivery
from tandem.engine.service.worker_intake import Intake
from tandem.engine.step_vote import PeersLost
from tandem.protocol import ErrorCode, Role
from tandem.registry_entry import EngineInfo

log = logging.getLogger(__name__)


# How often an idle rank of a busy data-parallel group asks Redis for work.
GROUP_POLL_S = 0.01
# Preemptions are said in the log at most this often, as a count (one a line flooded it).
PREEMPTIONS_SAID_EVERY_S = 10.0


class EngineWorker(Intake):
    def __init__(
        self,
        engine: Engine,
        settings: WorkerSettings,
        io: RedisIO,
        metrics: EngineMetrics,
        handoffs: HandoffFlow | None = None,
        *,
        vote: Callable[[int], int] | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.io = io
        self.metrics = metrics
        self.handoffs = handoffs
        if handoffs is not None:  # read at each scrape
            metrics.handoffs_parked.set_function(lambda: handoffs.num_parked)
        # Data-parallel ranks step together (all-reduce MIN across ranks): they
        # vote each turn on whether anyone is busy and whether everyone is done.
        self._vote = vote
        # Whether any rank had work at the last vote (this one's own work, alone).
        self._group_busy = False
        # Whether, at the last vote, ranks had work but none had run any at its last
        # step (each waiting for KV to arrive or to be fetched).
        self._group_stalled = False
        self._pulled_at = 0.0  # when it last asked Redis for work
        self._preemptions_said = (0, 0.0)  # the count last said, and when
        self._pull_paused_until = 0.0  # after handing parked handoffs back (monotonic)
        self.held: dict[str, Held] = {}
        # Pulled, not taken yet: Redis went away while they were being taken.
        self._untaken: list[Delivery] = []
        self._draining = False
        # Set by a signal handler (request_drain), applied by the loop: the handler runs
        # between any two bytecodes of the loop, which may hold the locks drain() takes.
        self._drain_requested = False
        self._drain_deadline = float("inf")
        self.last_loop_at = time.monotonic()
        self.heartbeat = Heartbeat(
            self.io.heartbeat,
            settings.heartbeat_every,
            loop_alive=lambda: time.monotonic() - self.last_loop_at < settings.stall_limit,
        )
        self.writes = RedisWrites(
            io,
            settings,
            self.heartbeat,
            handoffs,
            held=self._pending_deliveries,
            untaken=lambda: self._untaken,
            lost=self._lost,
            info=self._beat_info,
            orphans=lambda: [h.delivery for h in self.held.values() if not h.pending],
        )
        self.outage = self.writes.outage
        self._to_ack = self.writes.to_ack  # the same list: appended here, written there
        self.replies = Replies(io, metrics, settings.engine_id, self._to_ack, engine.tokenizer)

    # ------------------------------------------------------------ lifecycle

    def request_drain(self) -> None:
        """drain() at the loop's next turn: what a signal handler may call (SIGTERM)."""
        self._drain_requested = True

    def drain(self) -> None:
        """Stop taking work; finish what runs."""
        if not self._draining:
            log.info("draining (up to %.0fs)", self.settings.drain_timeout)
            self._draining = True
            self._drain_deadline = time.monotonic() + self.settings.drain_timeout
            self.writes.beat_soon()

    @property
    def draining(self) -> bool:
        return self._draining

    def run(self) -> int:
        self.io.start()
        self.heartbeat.start()
        try:
            while not self._drained():
                self.run_once()
            # Left when the drain timed out: another engine takes it over now.
            left = [h.delivery for h in self.held.values() if h.pending] + self._untaken
            self.writes.hand_back(left, len(self.held), "drain timed out")
        except PeersLost:
            # The group ends with its failed rank. What this rank holds is given back
            # (its tokens so far written: the next engine resumes after them), not left
            # to wait --claim-idle-ms for a takeover.
            left = [h.delivery for h in self.held.values()] + self._untaken
            self.writes.hand_back(left, len(self.held), "a peer rank ended")
            raise
        finally:
            self.heartbeat.stop()
            # Not while Redis is known away (the hand-back found it so): its entry
            # expires on its own, and the try waited out another socket timeout.
            if not self.outage.down or self.io.ping():
                self.io.deregister(self.settings.engine_id)
        return 0

    def _drained(self) -> bool:
        if self._drain_requested:
            self.drain()
        done = self._draining and (self._idle() or time.monotonic() > self._drain_deadline)
        if self._vote is not None:  # every rank must be done, or none leaves
            done = self._vote(1 if done else 0) == 1
        return done

    def _idle(self) -> bool:
        pinned = self.handoffs is not None and self.handoffs.num_offers > 0
        work = self.engine.has_unfinished_requests() or self.held or pinned or self._untaken
        # Written, too: what an outage held back is not to be lost to an exit.
        return not work and not self.writes.unwritten

    def run_once(self) -> None:
        self.last_loop_at = time.monotonic()
        offers = self._num_offers()
        ended = self._absorb()
        ended |= self._expire()
        if ended or self._num_offers() < offers:
            # KV freed (a request ended, an offer fetched or expired): an engine left
            # idle steps no more, and its gauges would wait for a heartbeat.
            self.metrics.observe_queues(self.engine)
        busy = self.engine.has_unfinished_requests()
        # The vote makes every rank wait for the slowest: a rank of a busy group never
        # blocks for work (a ~100 ms read held every step: 10 tokens/s), and asks Redis
        # only every GROUP_POLL_S (a round trip each step cost a third of the time).
        now = time.monotonic()
        stalled = busy and self.engine.last_step.num_seqs == 0
        if stalled and (self._vote is None or self._group_stalled):
            # The last step ran nothing, its requests waiting for KV a decoder has yet
            # to fetch (a PROMPT engine's pool full of offers) or for fetches in flight
            # (a COMPLETION engine's): wait for that, idle_block_ms at most (a group's
            # rank, where no rank ran anything, GROUP_POLL_S: its peers wait in the
            # vote). Looping, it spun a core and ran a pull on the shared Redis every
            # few microseconds. A decoder pulls first (a handoff's fetch starts beside
            # those in flight), once a wait; another engine pulls nothing (a prompt taken
            # now would wait too, where an engine with room would start it).
            wait_s = self.settings.idle_block_ms / 1000
            if self.settings.role is Role.COMPLETION and now - self._pulled_at >= wait_s:
                self._pulled_at = now
                self._pull(block=False)
            self._wait_for_room(wait_s if self._vote is None else GROUP_POLL_S)
            # What the news reported (a fetch landed), taken before this turn's step:
            # absorbed only at the next turn, that step ran empty, and the next turn,
            # reading stalled again with the news spent, waited out another wait.
            if self._absorb():
                self.metrics.observe_queues(self.engine)
        elif busy or not self._group_busy or now - self._pulled_at >= GROUP_POLL_S:
            self._pulled_at = now
            self._pull(block=not busy and not self._group_busy)
        busy = self.engine.has_unfinished_requests()
        if self._vote is not None:  # an idle rank steps (empty) while any rank works
            # 0: work it may run, 1: work it ran none of at its last step, 2: none.
            least = self._vote(0 if busy and not stalled else 1 if busy else 2)
            busy, self._group_stalled = least < 2, least == 1
        self._group_busy = busy
        if busy:
            self._publish(self.engine.step())
            self.metrics.observe_step(self.engine)
            self._say_preemptions()
        self.writes.after_step(len(self.held))

    def _wait_for_room(self, timeout: float) -> None:
        if self.handoffs is not None:
            self.handoffs.wait_for_news(timeout)
        else:
            time.sleep(timeout)

    def _say_preemptions(self) -> None:
        """A line for the requests preempted since the last one (at most every
        PREEMPTIONS_SAID_EVERY_S): only /metrics told of a KV cache too small for the load."""
        count, said_at = self._preemptions_said
        now, total = time.monotonic(), self.engine.totals.preemptions
        if total > count and now - said_at >= PREEMPTIONS_SAID_EVERY_S:
            log.info(
                "%d request(s) preempted (the KV cache was full): each is recomputed as "
                "room frees; a larger cache or fewer sequences (--max-num-seqs) avoid it",
                total - count,
            )
            self._preemptions_said = (total, now)

    # ---------------------------------------------------------------- input

    def _num_offers(self) -> int:
        return 0 if self.handoffs is None else self.handoffs.num_offers

    def _absorb(self) -> bool:
        """Cancels heard of and handoffs done; whether a request ended."""
        handoffs, ended = self.handoffs, False
        for rid in self.io.cancelled(self._watched, redis_up=not self.outage.down):
            if handoffs is not None and handoffs.offered(rid):
                # No decoder will fetch it: unpin its KV now, not at the offer's expiry.
                handoffs.withdraw_cancelled(self.engine, rid, self.io, CANCELLED)
            self._end(rid, ErrorCode.CANCELLED, CANCELLED)
            ended = True
        if self.handoffs is not None:
            for rid in self.handoffs.absorb(self.engine, self.metrics):
                held = self.held.get(rid)
                if held is not None and held.dropped:
                    self._drop(rid)
                elif held is not None and held.end_with is not None:
                    self._end(rid, *held.end_with)
                    ended = True
        return ended

    def _watched(self) -> list[str]:
        """The requests a cancel concerns here: those held, and those whose KV is offered."""
        return [*self.held, *(self.handoffs.offered_ids() if self.handoffs is not None else [])]

    def _expire(self) -> bool:
        """Ends what passed its deadline, and expired offers; whether a request ended."""
        now, ended = time.time(), False
        for rid, held in list(self.held.items()):
            deadline = held.work.deadline
            if deadline is not None and now > deadline:
                self._end(rid, ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed")
                ended = True
        if self.handoffs is not None:
            self.handoffs.expire_offers(self.engine, now)
        return ended

    # --------------------------------------------------------------- output

    def _publish(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            held = self.held.get(out.request_id)
            if held is None:
                continue
            # Text may come without tokens: a resumed detokenizer that found a stop
            # releases the text before it that the last engine held back.
            if out.new_token_ids or out.text_delta:
                self.replies.tokens(held, out)
            if out.finish_reason is FinishReason.ERROR:
                self.replies.fail(
                    held.delivery,
                    held.work,
                    ErrorCode.ENGINE_ERROR,
                    out.error or "",
                    offset=out.num_output_tokens,
                )
                self.held.pop(out.request_id, None)
            elif out.finish_reason is FinishReason.HANDOFF:
                # Its work entry is acknowledged as the handoff is published, at once.
                self.handoffs.offer(self.engine, held.work, out, held.delivery)
                self.held.pop(out.request_id, None)
                self.metrics.request_ended("handoff")
            elif out.finished and out.finish_reason is not FinishReason.ABORT:
                self.replies.finish(held, out)
                self.held.pop(out.request_id, None)

    def _end(self, rid: str, code: ErrorCode, message: str) -> None:
        """Cancel or time out a request: free its KV now, tell the client why."""
        held = self.held.get(rid)
        if held is None:
            return
        if self.handoffs is not None and self.handoffs.fetching(rid):
            held.end_with = (code, message)  # its blocks are being written: wait
            return
        if self.handoffs is not None:
            self.handoffs.drop(self.engine, rid, ending=True)
        self.engine.abort(rid)
        offset = max(held.sent, held.written)
        self.replies.fail(held.delivery, held.work, code, message, offset=offset)
        self.held.pop(rid, None)

    def _drop(self, rid: str) -> None:
        """Forget a request another engine now owns: free its KV (an offer's too),
        publish, write and ack nothing."""
        if self.handoffs is not None:
            if self.handoffs.fetching(rid):
                # Its blocks are being written: dropped as the fetch ends (_absorb). Left
                # to the next keep-alive, it ran and wrote for up to keep_alive_every.
                if (held := self.held.get(rid)) is not None:
                    held.dropped = True
                return
            self.handoffs.drop(self.engine, rid)
        if self.held.pop(rid, None) is not None:
            self.engine.abort(rid)
        self.io.responses.discard(rid)  # what this step made for it is stale now

    # ---------------------------------------------------------- bookkeeping

    def _lost(self, delivery: Delivery, elsewhere: bool) -> None:
        if elsewhere:  # another engine took it over or finished it: leave it to that one
            self._drop(delivery.request_id)
        elif (held := self.held.get(delivery.request_id)) is not None:
            held.pending = False  # Redis lost its entry: nobody else will serve it
            log.info("%s: Redis lost its entry; served on here", delivery.request_id)

    def _pending_deliveries(self) -> list[Delivery]:
        """The entries this engine still owes an outcome, kept alive while it works."""
        held = [h.delivery for h in self.held.values() if h.pending]
        return held + (self.handoffs.publishing() if self.handoffs is not None else [])

    def _beat_info(self) -> EngineInfo:
        self.metrics.observe_queues(self.engine)  # the gauges, as often as the registry
        sched = self.engine.scheduler
        return self.settings.engine_info(
            draining=self._draining,
            kv_usage=sched.kv_usage,
            running=sched.num_running,
            waiting=sched.num_waiting,
            waiting_prompt_tokens=sched.waiting_prompt_tokens,
            max_model_len=sched.config.max_model_len,
        )
