"""Data-parallel ranks voting on each step's type through a real all-reduce MIN.

Each rank is a thread with its own Scheduler; the vote is a barrier-based
all-reduce (ThreadVote), the same contract as the gloo vote between processes.
"""

import random
import threading
from dataclasses import dataclass, field

from support.scheduler_integrity import check_integrity
from support.stepping import fake_result

from tandem.engine.config import EngineConfig
from tandem.engine.dp_vote import ThreadVote
from tandem.engine.request import Request, SamplingParams
from tandem.engine.scheduler import Scheduler

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


@dataclass
class Trace:
    """What one rank did at each step."""

    kinds: list[bool] = field(default_factory=list)  # is_prefill
    counters: list[int] = field(default_factory=list)  # decode_step when planned
    scheduled: list[list[str]] = field(default_factory=list)


def run_ranks(schedulers, num_steps, arrivals=None):
    """Step every rank num_steps times in lockstep; arrivals[rank][step] are added first."""
    arrivals = arrivals or {}
    traces = [Trace() for _ in schedulers]
    errors = []

    def rank_loop(rank):
        sched, trace = schedulers[rank], traces[rank]
        try:
            for k in range(num_steps):
                for request in arrivals.get(rank, {}).get(k, []):
                    sched.add_request(request)
                plan = sched.schedule()
                trace.kinds.append(plan.is_prefill)
                trace.counters.append(plan.decode_step)
                trace.scheduled.append(list(plan.num_scheduled_tokens))
                sched.update(plan, fake_result(plan))
        except Exception as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(len(schedulers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a rank hung in a vote"
    for trace in traces[1:]:  # every rank agrees on every step's type and counter
        assert trace.kinds == traces[0].kinds
        assert trace.counters == traces[0].counters
    return traces


def ranks(n, **fields):
    """n schedulers, one per rank, voting through one ThreadVote."""
    config = EngineConfig(max_model_len=1024, data_parallel_size=n, **fields)
    votes = ThreadVote(n)
    return [Scheduler(config, num_blocks=2048, vote=votes.vote(rank)) for rank in range(n)]


def long_decodes(n):
    """Each rank starts with a long decode running (prefilled at step 0)."""
    return {rank: {0: [Request(f"long{rank}", list(range(32)), LONG)]} for rank in range(n)}


def test_all_point_needs_every_rank_and_any_point_needs_one():
    scheds = ranks(2)
    arrivals = long_decodes(2)
    arrivals[0][6] = [Request("new", list(range(100, 164)), LONG)]  # counter is 5 then
    traces = run_ranks(scheds, 110, arrivals)
    t0, t1 = traces
    prompt_steps = [k for k, is_prefill in enumerate(t0.kinds) if is_prefill]
    # Step 0 prefills the long decodes; the ALL point at 70 fails (rank 1 has
    # nothing to prefill); the ANY point at 100 succeeds.
    assert prompt_steps == [0, 101]
    assert t0.counters[101] == 100
    assert t0.scheduled[101] == ["new"]
    assert t1.scheduled[101] == []  # rank 1 runs an empty prompt step in lockstep
    assert t0.counters[102] == 0


def test_a_prompt_on_an_idle_group_is_prefilled_at_once():
    # Nothing decodes on any rank: waiting for the ANY point would be ~100 empty
    # steps (10 s on a served group whose idle steps wait for work).
    t0, t1 = run_ranks(ranks(2), 12, {0: {5: [Request("new", list(range(100, 140)), LONG)]}})
    assert [k for k, p in enumerate(t0.kinds) if p] == [5]
    assert t0.scheduled[5] == ["new"] and t1.scheduled[5] == []
    # Once a rank decodes, the group is back on the attempt points.
    assert not any(t0.kinds[6:])


def test_a_prompts_chunks_run_back_to_back_while_a_peer_decodes():
    # The ALL point after each chunk failed (the peer decoding wants no prefill): each
    # chunk waited 100 decode steps for the ANY point, ~1,600 for a 128k-token prompt.
    scheds = ranks(2, enable_chunked_prefill=True, max_num_batched_tokens=256)
    arrivals = long_decodes(2)
    arrivals[0][6] = [Request("big", list(range(100, 700)), LONG)]  # 256 + 256 + 88
    t0, t1 = run_ranks(scheds, 110, arrivals)
    chunks = [k for k, plan in enumerate(t0.scheduled) if "big" in plan and t0.kinds[k]]
    assert chunks == [101, 102, 103]  # the first at the ANY point, the rest at once
    assert not any(t1.scheduled[k] for k in chunks)  # the peer runs empty steps beside
    assert t0.kinds[104] is False  # then both decode


def test_all_point_prefills_when_every_rank_wants():
    scheds = ranks(3)
    arrivals = long_decodes(3)
    for rank in range(3):
        arrivals[rank][6] = [Request(f"new{rank}", list(range(200, 230)), LONG)]
    t0, *_ = run_ranks(scheds, 80, arrivals)
    assert [k for k, p in enumerate(t0.kinds) if p] == [0, 71]
    assert t0.counters[71] == 70


def test_any_wins_where_both_points_fall():
    scheds = ranks(2, prefill_attempt_interval=50, prefill_any_attempt_interval=100)
    arrivals = long_decodes(2)
    arrivals[1][3] = [Request("new", list(range(100, 130)), LONG)]
    t0, t1 = run_ranks(scheds, 105, arrivals)
    # ALL points at 50 fail (rank 0 does not want); 100 is both ALL and ANY: ANY wins.
    assert [k for k, p in enumerate(t0.kinds) if p] == [0, 101]
    assert t1.scheduled[101] == ["new"] and t0.scheduled[101] == []


def test_full_slots_with_waiting_work_do_not_livelock_on_empty_prompt_steps():
    scheds = ranks(2, max_num_seqs=2)
    arrivals = {
        rank: {
            0: [Request(f"r{rank}-{i}", list(range(10 * i, 10 * i + 8)), LONG) for i in range(4)]
        }
        for rank in range(2)
    }
    t0, _ = run_ranks(scheds, 400, arrivals)
    # Step 0 admits two per rank; afterwards every attempt point wants prefill
    # (requests wait, KV is nearly empty) but no rank can schedule: the second
    # vote turns each of those steps into decode, so the counter keeps climbing.
    assert t0.kinds[0] and not any(t0.kinds[1:])
    assert t0.counters[-1] == 398
    assert all(len(s.waiting) == 2 for s in scheds)


def test_random_arrivals_keep_ranks_in_lockstep_and_every_request_finishes():
    rng = random.Random(7)
    n = 3
    scheds = ranks(n, prefill_attempt_interval=7, prefill_any_attempt_interval=11)
    arrivals = {rank: {} for rank in range(n)}
    made = []
    for i in range(40):
        rank, at = rng.randrange(n), rng.randrange(150)
        params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True)
        request = Request(f"q{i}", [rng.randrange(500) for _ in range(rng.randint(1, 60))], params)
        arrivals[rank].setdefault(at, []).append(request)
        made.append(request)
    traces = run_ranks(scheds, 600, arrivals)
    assert all(r.is_finished for r in made)
    assert all(not s.has_unfinished_requests() for s in scheds)
    # Empty prompt steps happened on some rank while another prefilled.
    assert any(
        traces[a].kinds[k] and not traces[a].scheduled[k] and traces[b].scheduled[k]
        for k in range(600)
        for a in range(n)
        for b in range(n)
    )
    for sched in scheds:
        check_integrity(sched)


def test_a_prompt_chunked_on_a_tight_pool_beside_decodes_finishes_with_its_neighbours():
    # Rank 0 decodes B while the 40-token prompt A is prefilled a chunk at a time
    # (rank 1, busy decoding, never wants prefill). When A's chunks ran at the ANY points
    # only, B ran out of blocks between them, was preempted to the queue's front, ahead
    # of A, and waited there for the blocks A holds: rank 0 scheduled nothing from then
    # on. Now the chunks run back to back, and nothing decodes between them.
    config = EngineConfig(
        max_model_len=64,
        block_size=4,
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        data_parallel_size=2,
        prefill_attempt_interval=4,
        prefill_any_attempt_interval=6,
    )
    votes = ThreadVote(2)
    scheds = [Scheduler(config, num_blocks=16, vote=votes.vote(rank)) for rank in range(2)]
    b = Request("B", [1, 2, 3, 4], SamplingParams(max_tokens=40, ignore_eos=True))
    a = Request("A", list(range(100, 140)), SamplingParams(max_tokens=8, ignore_eos=True))
    busy = {k: [Request(f"C{k}", [1, 2, 3, 4], LONG)] for k in range(0, 400, 60)}
    t0, _ = run_ranks(scheds, 400, {0: {0: [b], 10: [a]}, 1: busy})
    chunks = [k for k, plan in enumerate(t0.scheduled) if "A" in plan and t0.kinds[k]]
    # (Later prompt steps of A's: recomputes, once preempted while it decodes.)
    assert chunks[:5] == list(range(chunks[0], chunks[0] + 5))  # 40 tokens, 8 a step
    assert a.is_finished and b.is_finished
    check_integrity(scheds[0])
