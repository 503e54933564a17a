"""A request's life in the step scheduler: preemption, stops, aborts, limits, prefix cache."""

import pytest
from support.scheduler_integrity import check_integrity
from support.stepping import LONG, fake_result, make, next_token, prompt, run_until_idle, step

from tandem.engine.request import Request, RequestStatus, SamplingParams

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
        check_integrity(sched)
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


def test_a_recompute_does_not_count_as_the_clients_cached_prompt():
    # The recompute after a preemption finds the request's own blocks in the prefix
    # cache (prompt and generated tokens alike); usage's cached_tokens is what the
    # cache saved of the client's prompt, at its first admission: here nothing.
    sched = make(num_blocks=14, max_model_len=40, block_size=4)
    first = Request("old", prompt(10), SamplingParams(max_tokens=30, ignore_eos=True))
    second = Request("new", prompt(10, 100), SamplingParams(max_tokens=30, ignore_eos=True))
    sched.add_request(first)
    sched.add_request(second)
    recomputes = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        if plan.is_prefill and second.num_preemptions:
            recomputes.append(plan.num_prefix_cached_tokens)
    assert second.num_preemptions and recomputes[0] > 10  # more than its whole prompt
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 0)


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
    check_integrity(sched)


def test_a_request_aborted_while_its_step_runs_is_skipped_by_update():
    sched = make(max_model_len=256)
    sched.add_request(Request("a", prompt(8), LONG))
    plan = sched.schedule()
    sched.abort_request("a")
    assert sched.update(plan, fake_result(plan)) == []


def test_a_request_added_again_while_its_aborted_step_ran_is_not_given_that_steps_token():
    # Matched by id alone, the old plan's sampled token went into the new request,
    # still waiting and holding no blocks: a token its client never asked for.
    sched = make(max_model_len=256)
    sched.add_request(Request("a", prompt(8), LONG))
    plan = sched.schedule()
    sched.abort_request("a")
    sched.add_request(Request("a", prompt(7, 9), LONG))  # a client's retry, same id
    assert sched.update(plan, fake_result(plan)) == []
    again = sched.requests["a"]
    assert again.token_ids == prompt(7, 9) and again.num_computed_tokens == 0
    check_integrity(sched)


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
    with pytest.raises(ValueError, match="the prompt is empty"):
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


def test_prompts_of_one_step_share_the_blocks_an_earlier_one_fills():
    # n choices of one prompt (n work items) and a burst sharing a system prompt were
    # prefilled in one step, each computing the whole prompt: blocks were offered to the
    # cache only after the step. A layer's KV is written for every sequence before any
    # attends, so the later ones read the blocks the first fills in the same step.
    sched = make(max_model_len=1024, max_num_batched_tokens=4096)
    shared = prompt(100)
    requests = [
        Request("a", shared, SamplingParams(max_tokens=2)),
        Request("b", shared, SamplingParams(max_tokens=2)),
        Request("c", [*shared[:40], 7, 7], SamplingParams(max_tokens=2)),
        Request("salted", shared, SamplingParams(max_tokens=2), cache_salt="s"),
    ]
    for request in requests:
        sched.add_request(request)
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 100, "b": 4, "c": 10, "salted": 100}
    assert [s.start_pos for s in plan.seqs] == [0, 96, 32, 0]
    table = {s.request_id: s.block_ids for s in plan.seqs}
    assert table["b"][:6] == table["a"][:6] and table["c"][:2] == table["a"][:2]
    assert not set(table["salted"]) & set(table["a"])  # another salt's, never shared
    sched.update(plan, fake_result(plan))
    check_integrity(sched)
    assert [r.num_cached_tokens for r in requests] == [0, 96, 32, 0]
    run_until_idle(sched)
    check_integrity(sched)
    assert sched.kv.usage == 0.0


def test_a_prompt_after_a_last_chunk_shares_the_blocks_that_step_completes():
    # Blocks filled in earlier steps are cached; those of the last chunk are shared too.
    sched = make(max_model_len=1024, max_num_batched_tokens=40, enable_chunked_prefill=True)
    shared = prompt(100)
    sched.add_request(Request("a", shared, SamplingParams(max_tokens=2)))
    sched.add_request(Request("b", shared, SamplingParams(max_tokens=2)))
    for _ in range(2):  # the budget spent on a's chunks: b waits
        plan, _ = step(sched)
        assert plan.num_scheduled_tokens == {"a": 40}
    # a's last chunk, 80-100, fills block 5 (80-95): b shares blocks 0-4 (cached) and 5.
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 20, "b": 4}
    assert plan.seqs[1].start_pos == 96
    run_until_idle(sched)
    check_integrity(sched)


def test_a_salted_prompt_shares_cached_blocks_only_with_its_own_salt():
    sched = make(max_model_len=1024)
    shared = prompt(100)

    def cached(rid: str, salt: str | None) -> int:
        request = Request(rid, [*shared, 7], SamplingParams(max_tokens=2), cache_salt=salt)
        sched.add_request(request)
        plan, _ = step(sched)
        run_until_idle(sched)
        return plan.num_prefix_cached_tokens

    assert cached("tenant-a", "a") == 0
    assert cached("tenant-b", "b") == 0, "another salt's blocks are not its own"
    assert cached("unsalted", None) == 0, "nor the shared cache's"
    assert cached("tenant-a-again", "a") == 96
    assert cached("unsalted-again", None) == 96


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
    check_integrity(sched)
