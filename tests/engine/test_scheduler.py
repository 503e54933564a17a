"""The step scheduler's rules on one rank (docs/scheduler.md)."""

import pytest
from support.stepping import accept_all, fake_result, next_token, run_until_idle, step

from tandem.engine.admission import PromptTooLongError
from tandem.engine.config import EngineConfig
from tandem.engine.plan import StepResult
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import Scheduler

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


def make(num_blocks=4096, **fields):
    return Scheduler(EngineConfig(**fields), num_blocks=num_blocks)


def prompt(n, offset=0):
    return [offset + i for i in range(n)]


def start_long_decode(sched, decode_step):
    """A long decode runs, and the counter stands at decode_step."""
    sched.add_request(Request("long", prompt(32), LONG))
    plan, _ = step(sched)
    assert plan.is_prefill
    while sched.decode_step < decode_step:
        assert not step(sched)[0].is_prefill


# ------------------------------------------------------------- NORMAL: points


def test_worked_example_request_at_counter_5_is_prefilled_at_70():
    sched = make(max_model_len=2048)
    start_long_decode(sched, 5)
    sched.add_request(Request("new", prompt(64, 5000), LONG))
    counters = []
    while True:
        counters.append(sched.decode_step)
        plan, _ = step(sched)
        if plan.is_prefill:
            break
    assert len(counters) - 1 == 65  # 65 decode steps waited
    assert counters[-1] == 70  # prefilled exactly at the ALL point
    assert plan.decode_step == 70
    assert list(plan.num_scheduled_tokens) == ["new"]
    assert sched.decode_step == 0  # a prompt step resets the counter


def test_after_a_prompt_step_the_next_step_prefills_too_if_requests_wait():
    # Budget 4096: two 3000-token prompts cannot share one step.
    sched = make(max_model_len=4096)
    start_long_decode(sched, 5)
    sched.add_request(Request("a", prompt(3000, 10_000), LONG))
    sched.add_request(Request("b", prompt(3000, 20_000), LONG))
    while not (plan := step(sched)[0]).is_prefill:
        pass
    assert list(plan.num_scheduled_tokens) == ["a"]
    plan, _ = step(sched)  # counter 0: an ALL point again
    assert plan.is_prefill
    assert list(plan.num_scheduled_tokens) == ["b"]
    assert not step(sched)[0].is_prefill  # nothing waits: decode


def test_worst_case_wait_is_69_decode_steps():
    sched = make(max_model_len=2048)
    start_long_decode(sched, 1)
    sched.add_request(Request("new", prompt(16, 7000), LONG))
    waited = 0
    while not step(sched)[0].is_prefill:
        waited += 1
    assert waited == 69


def test_any_point_alone_triggers_prefill():
    sched = make(max_model_len=2048, prefill_attempt_interval=150, prefill_any_attempt_interval=100)
    start_long_decode(sched, 1)
    plan, _ = step(sched)  # counter 1: no point
    sched.add_request(Request("new", prompt(16, 7000), LONG))
    while not (plan := step(sched)[0]).is_prefill:
        pass
    assert plan.decode_step == 100


def test_between_points_every_step_decodes():
    sched = make(max_model_len=2048, prefill_attempt_interval=10, prefill_any_attempt_interval=15)
    start_long_decode(sched, 1)
    sched.add_request(Request("new", prompt(16, 7000), LONG))
    kinds = []
    for _ in range(8):
        plan, _ = step(sched)
        kinds.append(plan.is_prefill)
    assert kinds == [False] * 8  # counters 1..8 are not attempt points
    assert step(sched)[0].is_prefill is False  # counter 9
    assert step(sched)[0].is_prefill is True  # counter 10: ALL point


def test_an_idle_single_rank_prefills_at_once():
    sched = make(max_model_len=2048)
    sched.decode_step = 37  # idle steps counted earlier
    sched.add_request(Request("a", prompt(16), SamplingParams(max_tokens=1)))
    assert step(sched)[0].is_prefill


# ---------------------------------------------------------- the watermark


def test_no_prefill_above_the_kv_watermark_until_usage_drops():
    # 100 blocks of 16 tokens; the long request holds 91 of them: usage 0.91 > 0.90.
    sched = make(num_blocks=100, max_model_len=1600, prefill_attempt_interval=4)
    sched.add_request(Request("big", prompt(91 * 16 - 1), SamplingParams(max_tokens=20)))
    step(sched)
    assert sched.kv_usage > 0.90
    sched.add_request(Request("small", prompt(8, 9000), SamplingParams(max_tokens=2)))
    kinds = [step(sched)[0].is_prefill for _ in range(12)]
    assert not any(kinds)  # attempt points at 4, 8 and 12 are all refused
    while "big" in sched.requests:
        step(sched)
    assert sched.kv_usage < 0.90
    run_until_idle(sched)
    sched.check_integrity()


def test_watermark_does_not_stall_a_prompt_mid_chunk():
    # The chunked prompt alone pushes usage over 90 %: its later chunks must still run.
    sched = make(
        num_blocks=64,
        max_model_len=1024,
        max_num_batched_tokens=256,
        enable_chunked_prefill=True,
    )
    sched.add_request(Request("rag", prompt(1000), SamplingParams(max_tokens=3)))
    chunks = []
    while "rag" in sched.requests and sched.requests["rag"].status is RequestStatus.WAITING:
        plan, _ = step(sched)
        chunks.append(plan.num_scheduled_tokens.get("rag", 0))
    assert chunks == [256, 256, 256, 232]
    run_until_idle(sched)


# ------------------------------------------------- the budget and chunking


def test_chunked_prefill_20000_tokens_at_budget_8192():
    sched = make(max_model_len=32_768, max_num_batched_tokens=8192, enable_chunked_prefill=True)
    sched.add_request(Request("rag", prompt(20_000), SamplingParams(max_tokens=4)))
    chunks, sampled = [], []
    for _ in range(3):
        plan, outputs = step(sched)
        assert plan.is_prefill
        (seq,) = plan.seqs
        chunks.append(len(seq.token_ids))
        sampled.append([o.new_token_ids for o in outputs])
    assert chunks == [8192, 8192, 3616]
    assert sampled[0] == [] and sampled[1] == []  # no token from the first two chunks
    assert len(sampled[2]) == 1 and len(sampled[2][0]) == 1  # only the last chunk yields
    assert sched.requests["rag"].num_computed_tokens == 20_000


def test_chunks_attend_to_earlier_chunks_positions():
    sched = make(max_model_len=4096, max_num_batched_tokens=1024, enable_chunked_prefill=True)
    sched.add_request(Request("a", prompt(2500), SamplingParams(max_tokens=1)))
    starts = [step(sched)[0].seqs[0].start_pos for _ in range(3)]
    assert starts == [0, 1024, 2048]


def test_leftover_budget_starts_the_next_prompt_as_a_chunk():
    sched = make(max_model_len=4096, max_num_batched_tokens=1000, enable_chunked_prefill=True)
    sched.add_request(Request("a", prompt(700), SamplingParams(max_tokens=1)))
    sched.add_request(Request("b", prompt(700, 5000), SamplingParams(max_tokens=1)))
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 700, "b": 300}
    assert [s.sample for s in plan.seqs] == [True, False]


def test_without_chunking_a_prompt_that_does_not_fit_the_rest_waits():
    sched = make(max_model_len=4096)  # budget 4096
    sched.add_request(Request("a", prompt(3000), LONG))
    sched.add_request(Request("b", prompt(2000, 5000), LONG))
    sched.add_request(Request("c", prompt(100, 9000), LONG))
    plan, _ = step(sched)
    # b does not fit the 1096 left; c stays behind it (first come, first served).
    assert plan.num_scheduled_tokens == {"a": 3000}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_a_prompt_over_the_limit_is_refused_not_queued():
    sched = make(max_model_len=2048)
    with pytest.raises(
        PromptTooLongError, match=r"has 2049 tokens, more than this engine's limit of 2048"
    ):
        sched.add_request(Request("long", prompt(2049)))
    assert not sched.has_unfinished_requests()
    assert "long" not in sched.requests


def test_decode_respects_the_budget():
    sched = make(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=100)
    for i in range(80):
        sched.add_request(Request(f"r{i}", prompt(4, i * 10), LONG))
    while sched.waiting:
        step(sched)
    plan, _ = step(sched)
    assert not plan.is_prefill
    assert plan.total_tokens == 64


def test_max_num_seqs_bounds_running_requests():
    sched = make(max_model_len=64, max_num_seqs=3)
    for i in range(5):
        sched.add_request(Request(f"r{i}", prompt(4, i * 10), LONG))
    plan, _ = step(sched)
    assert len(plan.seqs) == 3
    assert sched.num_running == 3 and sched.num_waiting == 2


# -------------------------------------------------------- engine types


def test_prompt_engine_only_prefills_and_pins_kv_for_handoff():
    sched = make(engine_type="prompt", max_model_len=256)
    assert sched.schedule().is_prefill  # nothing to do: an empty prompt step
    sched.add_request(Request("a", prompt(40), SamplingParams(max_tokens=10)))
    plan, outputs = step(sched)
    assert plan.is_prefill
    assert outputs[0].status is RequestStatus.HANDOFF and len(outputs[0].new_token_ids) == 1
    assert sched.kv_usage > 0  # KV pinned for the decoder
    assert sched.num_running == 0 and "a" in sched.handoff
    for _ in range(3):
        assert sched.schedule().is_prefill
    sched.release_handoff("a")
    assert sched.kv_usage == 0
    sched.check_integrity()


def test_prompt_engine_does_not_pin_a_request_that_already_finished():
    sched = make(engine_type="prompt", max_model_len=256)
    sched.add_request(Request("a", prompt(8), SamplingParams(max_tokens=1)))
    _, outputs = step(sched)
    assert outputs[0].status is RequestStatus.FINISHED_LENGTH
    assert not sched.handoff and sched.kv_usage == 0


def _handoff(sched, rid, n, first_token=7, max_tokens=5):
    request = Request(rid, prompt(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return request, sched.admit_handoff(request, [first_token])


def test_completion_engine_decodes_handoffs_and_never_prefills_new_work():
    sched = make(engine_type="completion", max_model_len=256)
    with pytest.raises(ValueError, match="only decodes requests prefilled elsewhere"):
        sched.add_request(Request("x", prompt(8)))
    request, blocks = _handoff(sched, "a", 40)
    assert len(blocks) == 3  # room for the 40 prompt tokens' KV
    sched.handoff_received("a")
    plans = run_until_idle(sched)
    assert not any(p.is_prefill for p in plans)
    assert request.num_output_tokens == 5
    assert plans[0].seqs[0].token_ids == [7]  # decoding starts from the first token
    assert plans[0].seqs[0].start_pos == 40


def test_completion_engine_recomputes_a_handoff_it_could_not_fetch():
    sched = make(engine_type="completion", max_model_len=256)
    request, _ = _handoff(sched, "a", 40)
    sched.handoff_failed("a")
    plan, _ = step(sched)
    assert plan.is_prefill  # recompute: prompt and first token, sampling the second
    assert plan.seqs[0].token_ids == [*prompt(40), 7]
    run_until_idle(sched)
    assert request.num_output_tokens == 5
    sched.check_integrity()


def test_completion_engine_refuses_handoffs_it_has_no_room_for():
    sched = make(num_blocks=16, engine_type="completion", max_model_len=256)
    _, blocks = _handoff(sched, "a", 250)
    assert blocks is not None
    _, refused = _handoff(sched, "b", 250)
    assert refused is None
    assert "b" not in sched.requests
    sched.check_integrity()


# ---------------------------------------------------- speculative decoding


def spec_sched(**fields):
    return make(max_model_len=512, num_speculative_tokens=3, vocab_size=5000, **fields)


def test_after_prefill_drafts_are_placeholders_and_decode_feeds_1_plus_drafts():
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), LONG))
    step(sched)
    assert sched.requests["a"].draft_token_ids == [4999, 4999, 4999]
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 4}
    assert plan.seqs[0].token_ids[1:] == [4999, 4999, 4999]


def test_accepted_drafts_advance_the_sequence():
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), LONG))
    step(sched)
    plan = sched.schedule()
    seq = plan.seqs[0]
    outputs = sched.update(plan, StepResult({"a": [*seq.draft_token_ids, 42]}, {"a": [1, 2, 3]}))
    assert outputs[0].new_token_ids == [4999, 4999, 4999, 42]
    assert outputs[0].num_accepted_drafts == 3
    request = sched.requests["a"]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert sched.schedule().seqs[0].token_ids == [42, 1, 2, 3]


def test_more_rows_than_nextn_plus_one_are_refused():
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), LONG))
    step(sched)
    plan = sched.schedule()
    with pytest.raises(ValueError, match=r"at most 4 rows \(nextn \+ 1 = 4\)"):
        sched.update(plan, StepResult({"a": [4999, 4999, 4999, 1, 2]}))


def test_accepted_tokens_must_be_the_drafts():
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), LONG))
    step(sched)
    plan = sched.schedule()
    with pytest.raises(ValueError, match="accepted tokens differ from its drafts"):
        sched.update(plan, StepResult({"a": [1, 2]}))


def test_more_drafts_than_configured_are_refused():
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), LONG))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="4 drafts proposed, num_speculative_tokens is 3"):
        sched.update(plan, StepResult({"a": [1]}, {"a": [1, 2, 3, 4]}))


def test_drafts_are_trimmed_to_the_tokens_left():
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), SamplingParams(max_tokens=3, ignore_eos=True)))
    step(sched)  # 1 token out, 2 left: at most 1 draft is worth verifying
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 2}
    outputs = sched.update(plan, fake_result(plan, accept_all))
    assert outputs[0].status is RequestStatus.FINISHED_LENGTH
    assert sched.requests == {}


def test_speculation_needs_the_vocab_size():
    with pytest.raises(ValueError, match="needs vocab_size"):
        make(max_model_len=512, num_speculative_tokens=2)


# ------------------------------------------------------------ preemption


def test_decode_without_blocks_preempts_the_newest_and_recomputes_it():
    # 8 blocks of 4 tokens; two requests each need up to 4 blocks, so they collide.
    sched = make(num_blocks=8, max_model_len=32, block_size=4)
    sched.add_request(Request("old", prompt(10), SamplingParams(max_tokens=20, ignore_eos=True)))
    sched.add_request(
        Request("new", prompt(10, 100), SamplingParams(max_tokens=20, ignore_eos=True))
    )
    plans = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        plans.append(plan)
        sched.check_integrity()
    preempted = [rid for p in plans for rid in p.preempted_request_ids]
    assert preempted and set(preempted) == {"new"}
    assert sched.num_preemptions == len(preempted)
    # The recompute prefill replays the prompt and every token sampled so far.
    recompute = next(p for p in plans[1:] if p.is_prefill)
    assert len(recompute.seqs[0].token_ids) > 10


def test_preemption_never_changes_the_tokens_a_request_produces():
    def finals(num_blocks):
        sched = make(num_blocks=num_blocks, max_model_len=40, block_size=4)
        requests = [
            Request(f"r{i}", prompt(9, 50 * i), SamplingParams(max_tokens=30, ignore_eos=True))
            for i in range(4)
        ]
        for request in requests:
            sched.add_request(request)
        run_until_idle(sched)
        return [r.output_token_ids for r in requests], sched.num_preemptions

    roomy, none = finals(200)
    tight, some = finals(12)
    assert none == 0 and some > 0
    assert tight == roomy


def test_a_lone_request_too_big_for_the_pool_is_refused_at_construction():
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len 2048"):
        make(num_blocks=10, max_model_len=2048)


# ------------------------------------------------- stops, aborts, priority


def test_eos_and_stop_token_ids_end_a_request_and_free_its_kv():
    sched = make(max_model_len=256)
    eos = Request("eos", prompt(8), SamplingParams(max_tokens=50), eos_token_id=1003)
    stop = Request("stop", prompt(9, 50), SamplingParams(max_tokens=50, stop_token_ids=(1005,)))
    sched.add_request(eos)
    sched.add_request(stop)
    run_until_idle(sched)
    assert eos.status is stop.status is RequestStatus.FINISHED_STOPPED
    assert eos.output_token_ids[-1] == 1003 and 1003 not in eos.output_token_ids[:-1]
    assert stop.output_token_ids[-1] == 1005 and stop.num_output_tokens < 8
    assert sched.kv_usage == 0


def test_stop_inside_accepted_drafts_truncates_the_output():
    sched = spec_sched()
    request = Request("a", prompt(20), SamplingParams(max_tokens=50, stop_token_ids=(4999,)))
    sched.add_request(request)
    step(sched)
    plan = sched.schedule()
    outputs = sched.update(plan, StepResult({"a": [4999, 4999, 4999, 5]}))
    assert outputs[0].new_token_ids == [4999]
    assert outputs[0].status is RequestStatus.FINISHED_STOPPED
    assert outputs[0].num_accepted_drafts == 1  # the two after the stop are not kept


def test_ignore_eos_keeps_going_to_max_tokens():
    sched = make(max_model_len=256)
    request = Request(
        "a", prompt(8), SamplingParams(max_tokens=12, ignore_eos=True), eos_token_id=1003
    )
    sched.add_request(request)
    run_until_idle(sched)
    assert request.num_output_tokens == 12
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_max_model_len_caps_generation():
    sched = make(max_model_len=32)
    request = Request("a", prompt(30), LONG)
    sched.add_request(request)
    run_until_idle(sched)
    assert request.num_tokens == 32 and request.status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("where", ["waiting", "mid_chunk", "running", "handoff"])
def test_abort_frees_kv_at_once_wherever_the_request_is(where):
    engine_type = "prompt" if where == "handoff" else "normal"
    sched = make(
        max_model_len=2048,
        max_num_batched_tokens=512,
        enable_chunked_prefill=True,
        engine_type=engine_type,
    )
    sched.add_request(Request("a", prompt(1000 if where == "mid_chunk" else 40), LONG))
    if where != "waiting":
        step(sched)
    out = sched.abort_request("a")
    assert out.status is RequestStatus.FINISHED_ABORTED
    assert sched.kv_usage == 0 and not sched.has_unfinished_requests()
    assert sched.abort_request("a") is None  # already gone
    sched.check_integrity()


def test_a_request_aborted_while_its_step_runs_is_skipped_by_update():
    sched = make(max_model_len=256)
    sched.add_request(Request("a", prompt(8), LONG))
    plan = sched.schedule()
    sched.abort_request("a")
    assert sched.update(plan, fake_result(plan)) == []


def test_higher_priority_is_prefilled_first_but_never_splits_a_chunked_prompt():
    sched = make(max_model_len=4096, max_num_batched_tokens=1024, enable_chunked_prefill=True)
    sched.add_request(Request("chunked", prompt(2000), LONG))
    step(sched)
    sched.add_request(Request("low", prompt(8, 5000), LONG))
    sched.add_request(Request("high", prompt(8, 6000), LONG, priority=5))
    assert [r.request_id for r in sched.waiting] == ["chunked", "high", "low"]


def test_duplicate_request_ids_are_refused():
    sched = make(max_model_len=256)
    sched.add_request(Request("a", prompt(8)))
    with pytest.raises(ValueError, match="already in the engine"):
        sched.add_request(Request("a", prompt(8)))


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        Request("a", [])


# ------------------------------------------------------------ prefix cache


def test_a_repeated_prompt_skips_the_prefill_of_its_cached_blocks():
    sched = make(max_model_len=1024)
    shared = prompt(100)
    sched.add_request(Request("a", shared, SamplingParams(max_tokens=2)))
    run_until_idle(sched)
    sched.add_request(Request("b", [*shared, 7, 7], SamplingParams(max_tokens=2)))
    plan, _ = step(sched)
    assert plan.num_prefix_cached_tokens == 96  # six full blocks of 16
    assert plan.num_scheduled_tokens == {"b": 6}
    assert plan.seqs[0].start_pos == 96


def test_metrics_report_queue_and_cache_state():
    sched = make(max_model_len=1024)
    sched.add_request(Request("a", prompt(100), LONG))
    sched.add_request(Request("b", prompt(50, 500), LONG))
    assert sched.num_waiting == 2 and sched.waiting_prompt_tokens == 150
    step(sched)
    assert sched.num_running == 2 and sched.num_waiting == 0
    assert sched.kv_usage == pytest.approx((7 + 4) / 4096)


def test_a_decode_step_plans_each_running_sequence_once():
    sched = make(max_model_len=256)
    for i in range(3):
        sched.add_request(Request(f"r{i}", prompt(5, 10 * i), LONG))
    step(sched)
    plan = sched.schedule()
    assert [s.request_id for s in plan.seqs] == ["r0", "r1", "r2"]
    assert all(s.sample and len(s.token_ids) == 1 for s in plan.seqs)
    sched.update(plan, fake_result(plan, next_token))
    sched.check_integrity()


def test_blocks_filled_by_accepted_drafts_are_cached_under_their_tokens():
    # Accepted drafts that fill a block: the block is hashed over its own 16 tokens
    # (once they are appended), so a later prompt with the same prefix reuses it.
    sched = spec_sched()
    sched.add_request(Request("a", prompt(14), SamplingParams(max_tokens=8, ignore_eos=True)))
    plan = sched.schedule()  # prefill: samples token 15, proposes three drafts
    sched.update(plan, StepResult({"a": [50]}, {"a": [51, 52, 53]}))
    plan = sched.schedule()  # feeds 50, 51, 52, 53 at positions 14..17: all accepted
    sched.update(plan, StepResult({"a": [51, 52, 53, 54]}, {"a": [55]}))
    request = sched.requests["a"]
    assert request.num_computed_tokens == 18
    known = list(request.token_ids)
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    sched.add_request(Request("b", [*known[:16], 42], SamplingParams(max_tokens=1)))
    plan, _ = step(sched)
    assert plan.num_prefix_cached_tokens == 16
