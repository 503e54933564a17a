"""The step scheduler: decides what each engine step computes.

Faithful to the deepinfer scheduler (docs/scheduler.md has the rules and
where Tandem goes beyond them):
- PROMPT engines run prefill steps only, COMPLETION engines decode steps only,
  NORMAL engines choose per step with a decode-step counter and two kinds of
  attempt points: ALL (every rank must want prefill) and ANY (one rank is
  enough), decided by all-reduce MIN votes across data-parallel ranks.
- A rank wants prefill while KV usage is at most the watermark (90 %) and a
  request waits. A second vote turns the step into decode when no rank could
  actually schedule a prompt, so full slots never livelock on empty steps.
- One step holds at most max_num_batched_tokens tokens; long prompts are
  chunked when chunked prefill is on, and wait otherwise.
- With speculative decoding a decode step computes 1 + len(drafts) tokens per
  sequence and accepts at most that many.

Pure Python and no torch: the engine, the tests and the cluster simulator all
drive it the same way: schedule() -> runner -> update().
"""

from __future__ import annotations

from tandem.engine.admission import check_fits
from tandem.engine.block_pool import BlockHash
from tandem.engine.config import EngineConfig, EngineType
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.plan import RequestOutput, ScheduledSeq, StepPlan, StepResult
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler_handoff import HandoffSide
from tandem.engine.step_result import checked_samples
from tandem.engine.step_vote import Point, StepVote, Vote
from tandem.engine.waiting_queue import WaitingQueue

# While requests decode, prompt steps run at most this many in a row (a prompt mid-chunk
# finishes, as the seed has it); then a decode step, and the next attempt point.
MAX_PROMPT_STEPS_IN_A_ROW = 8


class Scheduler(HandoffSide):
    def __init__(self, config: EngineConfig, num_blocks: int, vote: Vote | None = None) -> None:
        if config.num_speculative_tokens and config.vocab_size is None:
            raise ValueError(
                "num_speculative_tokens > 0 needs vocab_size: after prefill the drafts "
                "are placeholders with id vocab_size - 1"
            )
        if num_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"{num_blocks} KV blocks of {config.block_size} tokens hold "
                f"{num_blocks * config.block_size} tokens, fewer than one sequence of "
                f"max_model_len {config.max_model_len}: give the cache more blocks or "
                "lower max_model_len"
            )
        self.config = config
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self._votes = StepVote(config, vote)
        self.requests: dict[str, Request] = {}
        # Prefill queue, highest priority first; a request mid-chunk is at the front.
        self.waiting = WaitingQueue(self.kv.holds_blocks)
        # Prefilled requests in admission order; the newest is preempted first.
        self.running: list[Request] = []
        # PROMPT engine: prefilled requests whose KV is pinned for a decoder to fetch.
        self.handoff: dict[str, Request] = {}
        # COMPLETION engine: requests whose KV is being fetched from a PROMPT engine.
        self.receiving: dict[str, Request] = {}
        # Decode steps since the last prompt step; the same on every rank.
        self.decode_step = 0
        # Prompt steps in a row since the last decode step; the same on every rank.
        self.prompt_steps_in_a_row = 0
        self.num_preemptions = 0

    # ----------------------------------------------------------- requests in

    def add_request(self, request: Request, *, exact_max_tokens: bool = False) -> None:
        """Queue a request for prefill; raises admission's errors (ValueErrors) for one
        that does not fit (admission.check_fits)."""
        if self.config.engine_type is EngineType.COMPLETION:
            raise ValueError(
                "a COMPLETION engine only decodes requests prefilled elsewhere: "
                "hand them over with admit_handoff()"
            )
        check_fits(
            self.config,
            request.num_prompt_tokens,
            request.sampling_params.max_tokens,
            exact_max_tokens=exact_max_tokens,
        )
        self._register(request)
        self.waiting.add(request)

    def _register(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} was already scheduled elsewhere")
        request.max_num_tokens = min(request.max_num_tokens, self.config.max_model_len)
        self.requests[request.request_id] = request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is and free its KV at once."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> RequestOutput | None:
        """End a request from outside the step loop (abort, stop string, deadline).

        Returns None if the engine does not know the request (already finished).
        """
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            if request_id in self.receiving:
                del self.receiving[request_id]
            else:
                self.waiting.remove(request)
        elif request.status is RequestStatus.HANDOFF:
            del self.handoff[request_id]
        self._retire(request, status)
        return RequestOutput(request_id, [], status)

    # ------------------------------------------------------------- the step

    def schedule(self) -> StepPlan:
        """Plan the next step. On several ranks, every rank calls this in lockstep."""
        if self.config.engine_type is EngineType.PROMPT:
            plan = self._schedule_prefill() or StepPlan(is_prefill=True)
        else:
            plan = self._schedule_by_vote()
        plan.decode_step = self.decode_step
        self.decode_step = 0 if plan.is_prefill else self.decode_step + 1
        self.prompt_steps_in_a_row = self.prompt_steps_in_a_row + 1 if plan.is_prefill else 0
        return plan

    def _schedule_by_vote(self) -> StepPlan:
        """NORMAL (and COMPLETION, whose queue only holds KV to recompute)."""
        votes = self._votes
        first = self.waiting.first()
        mid_chunk = first is not None and self.waiting.mid_chunk(first)
        point = votes.point(self.decode_step, idle=not self.running, mid_chunk=mid_chunk)
        if point is Point.NONE:
            return self._schedule_decode()
        want = self._wants_prefill()
        if not votes.agree_to_prefill(point, want):
            return self._schedule_decode()
        plan = self._schedule_prefill() if want else None
        if not votes.anyone_scheduled(plan is not None):
            return self._schedule_decode()
        # A rank with nothing to prefill runs an empty prompt step alongside.
        return plan or StepPlan(is_prefill=True)

    def _wants_prefill(self) -> bool:
        first = self.waiting.first()
        if first is None:
            return False
        if (
            self.prompt_steps_in_a_row >= MAX_PROMPT_STEPS_IN_A_ROW
            and self.running
            and not self.waiting.mid_chunk(first)
        ):
            # A prompt step's counter of 0 is an attempt point again, so prompts run
            # back to back, a burst's together; unbounded, a steady stream of short
            # prompts kept every running request from its next token for good.
            return False
        if self.kv.usage <= self.config.cache_prefill_watermark:
            return True
        # A prompt mid-chunk already holds all its blocks: finishing it costs no KV.
        return self.waiting.mid_chunk(first)

    def _schedule_prefill(self) -> StepPlan | None:
        """Admit waiting prompts in order until the budget, slots or blocks run out."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # Sequences whose KV is arriving run next: their slots are taken.
        slots = cfg.max_running - len(self.running) - len(self.receiving)
        waiting, kv = self.waiting, self.kv
        plan = StepPlan(is_prefill=True)
        computing: dict[BlockHash, int] = {}  # blocks this step fills, for the prompts after
        # Past the most in a row, a step only finishes prompts mid-chunk: a new one begun
        # with the leftover budget was mid-chunk at the next step, and a steady stream of
        # long prompts ran prompt steps without end (96 in a row seen).
        # As the step begins: what it admits runs too, but decodes only after it.
        capped = self.prompt_steps_in_a_row >= MAX_PROMPT_STEPS_IN_A_ROW and bool(self.running)
        while (request := waiting.first()) is not None and budget > 0 and slots > 0:
            rid = request.request_id
            admitted = kv.holds_blocks(rid)
            if not admitted and capped:
                break
            cached = [] if admitted else kv.match_prefix(request, computing)
            if not admitted and not self._admits(request, cached, plan):
                break
            start = request.num_computed_tokens if admitted else len(cached) * cfg.block_size
            num_new = request.num_tokens - start
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break  # waits for a step with room for the whole prompt
                num_new = budget
            if not admitted:
                # Reserve the whole prompt now, so a prompt mid-chunk never
                # waits on blocks another request holds.
                if kv.allocate(rid, request.num_tokens, cached) is None:
                    break
                request.block_ids = kv.block_table(rid)
                request.num_computed_tokens = start
                if not request.num_preemptions:  # a recompute saves none of the client's
                    request.num_cached_tokens = min(start, request.num_prompt_tokens)
                plan.num_prefix_cached_tokens += start
                plan.num_admitted_tokens += request.num_tokens
            end = start + num_new
            computing |= kv.completed_by(request, start, end)
            last_chunk = end == request.num_tokens
            plan.num_scheduled_tokens[rid] = num_new
            plan.seqs.append(
                ScheduledSeq(
                    request_id=rid,
                    token_ids=request.token_ids[start:end],
                    start_pos=start,
                    block_ids=request.block_ids,
                    sample=last_chunk,
                    draft_token_ids=[],
                    sampling_params=request.sampling_params,
                    num_output_tokens=request.num_output_tokens,
                    all_token_ids=request.token_ids,
                )
            )
            budget -= num_new
            slots -= 1
            if last_chunk:
                waiting.pop_first()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
        return plan if plan.seqs else None

    def _admits(self, request: Request, cached: list[int], plan: StepPlan) -> bool:
        """Whether a new prompt's blocks keep KV usage within the watermark, the room
        decodes grow into (read once a step, one step filled the pool with prompts the
        next decode step preempted). A PROMPT engine decodes nothing: no room kept. A
        prompt past the watermark alone is taken where nothing else runs, arrives (a
        handoff's KV: it decodes next) or is taken."""
        cfg, kv = self.config, self.kv
        alone = not (self.running or self.receiving or plan.seqs)
        if cfg.engine_type is EngineType.PROMPT or alone:
            return True
        taken = kv.blocks_taken(request.num_tokens, cached)
        return kv.usage_with(taken) <= cfg.cache_prefill_watermark

    def _schedule_decode(self) -> StepPlan:
        """Decode every running sequence that fits the budget; preempt for blocks.

        Each sequence's own next token first, oldest first, preempting the newest for
        blocks; then its drafts, as far as the budget and free blocks go: a guess
        (placeholders after a prefill are nearly always rejected) never preempts.
        """
        budget = self.config.max_num_batched_tokens
        block_size = self.config.block_size
        kv, running = self.kv, self.running
        plan = StepPlan(is_prefill=False)
        batch = 0
        while batch < len(running) and budget > 0:
            request = running[batch]
            start = request.num_computed_tokens
            if start + 1 > len(request.block_ids) * block_size:  # needs another block
                while kv.allocate(request.request_id, start + 1) is None:
                    victim = running.pop()  # the newest running request
                    self._preempt(victim)
                    plan.preempted_request_ids.append(victim.request_id)
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    break  # preempted itself: everything after it is gone too
            budget -= 1
            batch += 1
        for request in running[:batch]:
            drafts = self._drafts_that_fit(request, budget)
            budget -= len(drafts)
            tokens = request.token_ids
            plan.num_scheduled_tokens[request.request_id] = 1 + len(drafts)
            plan.seqs.append(
                ScheduledSeq(
                    request.request_id,
                    [tokens[-1], *drafts],
                    request.num_computed_tokens,
                    request.block_ids,
                    True,
                    drafts,
                    request.sampling_params,
                    len(tokens) - request.num_prompt_tokens,
                    tokens,
                )
            )
        return plan

    def _drafts_that_fit(self, request: Request, budget: int) -> list[int]:
        """The request's drafts to verify: never past max_tokens or max_model_len (a step
        yields at most 1 + len(drafts) tokens, the room left), within the budget left, and
        as far as free blocks go."""
        drafts = request.draft_token_ids
        if not drafts:
            return drafts
        fit = min(request.max_num_tokens - len(request.token_ids) - 1, budget)
        if len(drafts) > fit:
            drafts = drafts[: max(0, fit)]
        start = request.num_computed_tokens
        held = len(request.block_ids) * self.config.block_size
        # The blocks held most often hold them already: no allocate (a call per drafted
        # sequence a step made the 5-draft step ~1.4x slower).
        while (
            drafts
            and start + 1 + len(drafts) > held
            and self.kv.allocate(request.request_id, start + 1 + len(drafts)) is None
        ):
            drafts = drafts[:-1]
        return drafts

    def _preempt(self, request: Request) -> None:
        """Free a running request's KV and queue it to be recomputed: first, but behind
        a prompt mid-chunk, which holds its blocks (ahead of it, the victim waited for
        them, and prefill stalled for good; a decode between the chunks, as a
        data-parallel group's votes make, preempts)."""
        self.kv.free(request.request_id)
        request.block_ids = []
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_first(request)

    # ------------------------------------------------------------ results in

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply a step's result: advance computed tokens, append samples, finish."""
        cfg = self.config
        kv, requests = self.kv, self.requests
        block_size = cfg.block_size
        num_spec = cfg.num_speculative_tokens
        is_prefill = plan.is_prefill
        is_prompt_engine = cfg.engine_type is EngineType.PROMPT
        # Skipped: requests aborted while the step ran (and maybe added again, anew).
        live = [
            (seq, request)
            for seq in plan.seqs
            if (request := requests.get(seq.request_id)) is not None
            and request.token_ids is seq.all_token_ids
        ]
        sampled, drafted = checked_samples((seq for seq, _ in live), result, num_spec)
        outputs: list[RequestOutput] = []
        ended: list[Request] = []
        for seq, request in live:
            rid = seq.request_id
            start = seq.start_pos
            if not seq.sample:  # a prompt chunk: KV written, nothing sampled
                request.num_computed_tokens = start + len(seq.token_ids)
                kv.cache_computed(request)
                continue
            tokens = sampled[rid]
            num_accepted = len(tokens) - 1
            # Prefill: the whole chunk has KV. Decode: the fed tokens up to the
            # last accepted draft do; a rejected draft's KV is overwritten later.
            computed = start + (len(seq.token_ids) if is_prefill else len(tokens))
            request.num_computed_tokens = computed
            new_tokens, status = request.append_sampled(tokens)
            # After the append: a block that accepted drafts filled is hashed over them.
            if computed // block_size > start // block_size:
                kv.cache_computed(request)

            if status is not None:
                ended.append(request)
                self._retire(request, status)
            elif is_prompt_engine:
                status = RequestStatus.HANDOFF
                request.status = status
                ended.append(request)
                self.handoff[rid] = request
            elif num_spec:
                next_drafts = drafted[rid]
                if next_drafts is None:
                    # Nothing proposed after a prefill: placeholders keep decodes 1 + k wide.
                    next_drafts = [cfg.draft_placeholder_id] * num_spec if is_prefill else []
                request.draft_token_ids = next_drafts
                if not is_prefill and len(request.block_ids) > kv.blocks_for(computed + 1):
                    # Blocks taken for drafts it rejected go back now: kept, they starved
                    # the next step's own tokens, and a guess preempted a request.
                    kv.trim(rid, computed + 1)
            # Drafts kept: those before a stop that cut the step's tokens short.
            kept_drafts = min(num_accepted, len(new_tokens))
            outputs.append(RequestOutput(rid, new_tokens, status or request.status, kept_drafts))
        if ended:
            gone = set(map(id, ended))
            self.running = [r for r in self.running if id(r) not in gone]
        return outputs

    def _retire(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.draft_token_ids = []
        request.block_ids = []
        self.kv.free(request.request_id)
        del self.requests[request.request_id]

    # -------------------------------------------------------------- metrics

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Tokens still to prefill for every waiting request."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.receiving)
