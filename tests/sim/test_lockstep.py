"""Data-parallel ranks planning together through the real votes."""

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.plan import StepResult
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler
from tandem.sim.lockstep import Lockstep


def _ranks(lockstep, n):
    config = EngineConfig(data_parallel_size=n, enable_prefix_caching=False)
    return [Scheduler(config, 256, vote=lockstep.vote(r)) for r in range(n)]


def test_ranks_keep_the_same_step_type_and_counter():
    lockstep = Lockstep(2)
    try:
        ranks = _ranks(lockstep, 2)
        params = SamplingParams(max_tokens=50, ignore_eos=True)
        busy = SamplingParams(max_tokens=500, ignore_eos=True)
        ranks[1].add_request(Request("long", [2] * 10, busy))
        prefills = []
        for step in range(300):
            if step == 1:
                ranks[0].add_request(Request("a", [1] * 10, params))
            plans = lockstep.schedule_all(ranks)
            assert plans[0].is_prefill == plans[1].is_prefill
            assert ranks[0].decode_step == ranks[1].decode_step
            if plans[0].is_prefill:
                prefills.append(step)
            for sched, plan in zip(ranks, plans, strict=True):
                if plan.seqs:
                    sched.update(plan, StepResult({s.request_id: [0] for s in plan.seqs}))
            if not ranks[0].has_unfinished_requests() and step > 1:
                break
        # The idle group prefilled rank 1's prompt at once (an ANY point at every
        # step while no rank decodes). Then rank 1 decodes and never wants to
        # prefill, so the ALL point at 0 failed and rank 0's prompt waited for
        # the ANY point at 100.
        assert prefills == [0, 101]
        assert not ranks[0].has_unfinished_requests()
    finally:
        lockstep.close()


def test_a_rank_that_fails_fails_the_step():
    lockstep = Lockstep(2)
    try:
        ranks = _ranks(lockstep, 2)

        def broken():
            raise RuntimeError("rank 1 broke")

        ranks[1].schedule = broken
        with pytest.raises(RuntimeError, match="rank 1 broke"):
            lockstep.schedule_all(ranks)
    finally:
        lockstep.close()
