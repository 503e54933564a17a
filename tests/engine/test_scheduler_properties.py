"""Property-based tests: random arrivals, samples, finishes, aborts and preemptions.

Whatever happens, no block is leaked or freed twice, usage stays within [0, 1],
running sequences stay decodable, and every admitted request either finishes
or is aborted.
"""

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support.scheduler_integrity import check_integrity

from tandem.engine.admission import PromptTooLongError
from tandem.engine.config import EngineConfig
from tandem.engine.plan import StepResult
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler

EOS = 3
VOCAB = 64


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        chunked=st.booleans(),
        drafts=st.sampled_from([0, 2]),
        block_size=st.sampled_from([2, 4, 16]),
        spare_blocks=st.integers(0, 40),
        engine_type=st.sampled_from(["normal", "normal", "prompt"]),
        intervals=st.sampled_from([(70, 100), (3, 5), (1, 1)]),
    )
    def setup(self, chunked, drafts, block_size, spare_blocks, engine_type, intervals):
        max_model_len = 64
        self.config = EngineConfig(
            engine_type=engine_type,
            max_model_len=max_model_len,
            max_num_seqs=6,
            max_num_batched_tokens=24 if chunked else 64,
            enable_chunked_prefill=chunked,
            num_speculative_tokens=drafts,
            block_size=block_size,
            vocab_size=VOCAB,
            prefill_attempt_interval=intervals[0],
            prefill_any_attempt_interval=intervals[1],
        )
        # Just enough blocks for one full sequence, plus a few: preemption is common.
        num_blocks = -(-max_model_len // block_size) + spare_blocks
        self.sched = Scheduler(self.config, num_blocks=num_blocks)
        self.added: dict[str, Request] = {}
        self.next_id = 0

    @rule(
        length=st.integers(1, 80),
        max_tokens=st.integers(1, 40),
        shared_prefix=st.booleans(),
        priority=st.integers(0, 2),
    )
    def add(self, length, max_tokens, shared_prefix, priority):
        base = list(range(10, 10 + length)) if shared_prefix else []
        tokens = (base + [(self.next_id * 7 + i) % VOCAB for i in range(length)])[:length]
        request = Request(
            f"r{self.next_id}",
            tokens,
            SamplingParams(max_tokens=max_tokens),
            eos_token_id=EOS,
            priority=priority,
        )
        self.next_id += 1
        try:
            self.sched.add_request(request)
        except PromptTooLongError:
            assert length > self.config.prompt_limit
            return
        self.added[request.request_id] = request

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.abort_request(rid)
        assert rid not in self.sched.requests

    @precondition(lambda self: self.sched.handoff)
    @rule(data=st.data())
    def decoder_fetches(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.handoff)))
        self.sched.release_handoff(rid)

    @rule(data=st.data())
    def step(self, data):
        plan = self.sched.schedule()
        sampled, drafts = {}, {}
        for seq in plan.seqs:
            assert seq.start_pos + len(seq.token_ids) <= self.config.max_model_len
            if not seq.sample:
                continue
            accepted = data.draw(st.integers(0, len(seq.draft_token_ids)))
            token = data.draw(st.sampled_from([EOS, 5, 6, 7, 8, 9]))
            sampled[seq.request_id] = [*seq.draft_token_ids[:accepted], token]
            if self.config.num_speculative_tokens:
                drafts[seq.request_id] = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))
        assert plan.total_tokens <= self.config.max_num_batched_tokens
        if plan.preempted_request_ids:
            event("preempted")
        if any(not s.sample for s in plan.seqs):
            event("chunk")
        if plan.num_prefix_cached_tokens:
            event("prefix hit")
        if plan.is_prefill and not plan.seqs:
            event("empty prompt step")
        self.sched.update(plan, StepResult(sampled, drafts))

    @invariant()
    def bookkeeping_holds(self):
        check_integrity(self.sched)
        assert 0.0 <= self.sched.kv_usage <= 1.0

    @invariant()
    def nothing_is_lost(self):
        for rid, request in self.added.items():
            assert request.is_finished or rid in self.sched.requests

    def teardown(self):
        for rid in list(self.sched.handoff):
            self.sched.release_handoff(rid)
        steps = 0
        while self.sched.has_unfinished_requests():
            plan = self.sched.schedule()
            sampled = {s.request_id: [5] for s in plan.seqs if s.sample}
            self.sched.update(plan, StepResult(sampled))
            for rid in list(self.sched.handoff):
                self.sched.release_handoff(rid)
            steps += 1
            assert steps < 10_000, "requests never finish"
        check_integrity(self.sched)
        assert all(r.is_finished for r in self.added.values())
        assert self.sched.kv.pool.num_free == self.sched.kv.num_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
