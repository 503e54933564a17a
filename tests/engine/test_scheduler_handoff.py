"""The step scheduler's disaggregation: PROMPT engines hand KV off, COMPLETION ones decode."""

import pytest
from support.scheduler_integrity import check_integrity
from support.stepping import make, prompt, run_until_idle, step

from tandem.engine.request import Request, RequestStatus, SamplingParams

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
    check_integrity(sched)


def test_prompt_engine_does_not_pin_a_request_that_already_finished():
    sched = make(engine_type="prompt", max_model_len=256)
    sched.add_request(Request("a", prompt(8), SamplingParams(max_tokens=1)))
    _, outputs = step(sched)
    assert outputs[0].status is RequestStatus.FINISHED_LENGTH
    assert not sched.handoff and sched.kv_usage == 0


def _handoff(sched, rid, n, first_token=7, max_tokens=5):
    request = Request(rid, prompt(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return request, sched.admit_handoff(request, [first_token])


def test_handoffs_arriving_and_recomputes_waiting_hold_their_slots():
    sched = make(engine_type="completion", max_model_len=64, max_num_seqs=2)
    _handoff(sched, "a", 10, max_tokens=20)
    _handoff(sched, "b", 10, max_tokens=20)
    sched.handoff_failed("a")  # recomputed here, waiting for its prefill
    assert _handoff(sched, "c", 10)[1] is None, "two sequences held: no room for a third"
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 11}
    sched.handoff_received("b")
    assert len(sched.schedule().seqs) == 2
    check_integrity(sched)


def test_a_recompute_keeps_the_watermark_while_a_handoff_arrives():
    # Nothing running, a recompute was admitted past the watermark beside a handoff
    # whose KV was arriving: its first decode steps preempted it, the KV just fetched.
    sched = make(engine_type="completion", max_model_len=64, block_size=8, num_blocks=10)
    _handoff(sched, "b", 32, max_tokens=24)  # 4 of 10 blocks, arriving
    _handoff(sched, "a", 40, max_tokens=24)  # 5 more: 0.9, the watermark
    sched.handoff_failed("a")  # recomputed here: 41 tokens, 6 blocks
    plan, _ = step(sched)
    assert "a" not in plan.num_scheduled_tokens and sched.kv_usage <= 0.9
    sched.handoff_received("b")
    plans = []
    while sched.has_unfinished_requests():
        plans.append(step(sched)[0])
    assert not any(p.preempted_request_ids for p in plans)
    assert sched.num_preemptions == 0
    check_integrity(sched)


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
    check_integrity(sched)


def test_a_failed_handoff_waits_behind_a_recompute_mid_chunk():
    # Ahead of it, it would wait for blocks the prompt mid-chunk holds.
    sched = make(
        engine_type="completion",
        max_model_len=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
    )
    _handoff(sched, "a", 100)
    _handoff(sched, "b", 40)
    sched.handoff_failed("a")
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 32}  # "a" is mid-chunk
    sched.handoff_failed("b")
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    run_until_idle(sched)
    check_integrity(sched)


def test_a_completion_engine_past_the_watermark_refuses_a_handoff_it_could_fit():
    sched = make(num_blocks=100, engine_type="completion", max_model_len=256)
    assert _handoff(sched, "a", 20)[1] is not None
    assert sched.kv.allocate("filler", 89 * 16) is not None  # usage 0.91 > 0.90
    assert _handoff(sched, "h", 20)[1] is None


def test_a_handoff_is_taken_only_while_its_own_blocks_keep_usage_within_the_watermark():
    # Taken at 0.80 to 0.96, the next decode step preempted the request whose KV had
    # just come over the network, to recompute it here.
    sched = make(num_blocks=100, engine_type="completion", max_model_len=256)
    for rid in "abcde":
        assert _handoff(sched, rid, 250)[1] is not None  # 16 blocks each: 0.80
    assert _handoff(sched, "f", 250)[1] is None  # 0.96
    assert _handoff(sched, "g", 160)[1] is not None  # 10 blocks: exactly 0.90
    check_integrity(sched)


def test_a_handoff_past_the_watermark_alone_is_taken_where_nothing_else_runs():
    sched = make(num_blocks=16, engine_type="completion", max_model_len=256)
    assert _handoff(sched, "a", 250)[1] is not None  # 16 of 16 blocks


def test_no_handoff_takes_the_room_a_waiting_recompute_needs():
    # Handoffs took every block freed, a failed fetch's recompute none: it waited until
    # its deadline while a steady stream of others finished.
    sched = make(num_blocks=100, engine_type="completion", max_model_len=256)
    for rid in "abcde":
        _handoff(sched, rid, 250)
    sched.handoff_failed("a")  # 0.64 in use, and the recompute's 16 blocks to come
    assert _handoff(sched, "f", 250)[1] is None  # 0.96 with them
    assert _handoff(sched, "g", 20)[1] is not None  # beside them: 0.82
    for rid in "bcdeg":
        sched.handoff_received(rid)
    plans = run_until_idle(sched)
    assert any(plan.is_prefill and "a" in plan.num_scheduled_tokens for plan in plans)
    check_integrity(sched)


def test_a_recompute_mid_chunk_counts_its_blocks_once_against_a_handoff():
    # It holds all its blocks from its first chunk on: counted again as room it needed,
    # handoffs that fitted were refused through all of its chunks.
    sched = make(
        num_blocks=100,
        engine_type="completion",
        max_model_len=1000,
        enable_chunked_prefill=True,
        max_num_batched_tokens=100,
    )
    _handoff(sched, "a", 599)  # 38 blocks of 16 tokens
    sched.handoff_failed("a")
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 100} and sched.kv.usage == 0.38  # mid-chunk
    assert _handoff(sched, "b", 800)[1] is not None  # 51 more: 0.89 (a's 38 twice: 1.27)
    assert _handoff(sched, "c", 100)[1] is None  # 7 more: 0.96
    check_integrity(sched)


def test_a_waiting_recompute_leaves_a_near_empty_decoder_taking_handoffs():
    # Any recompute waiting refused every handoff until the next attempt point (~70
    # decode steps), with 99 % of the pool free.
    sched = make(num_blocks=100, engine_type="completion", max_model_len=256)
    _handoff(sched, "a", 20)
    _handoff(sched, "b", 20)
    sched.handoff_received("a")
    step(sched)  # a decode step: the counter passes its attempt point
    sched.handoff_failed("b")
    step(sched)  # another: the recompute waits for the next point
    assert sched.waiting and _handoff(sched, "c", 20)[1] is not None
    check_integrity(sched)


def test_completion_engine_refuses_handoffs_it_has_no_room_for():
    sched = make(num_blocks=16, engine_type="completion", max_model_len=256)
    _, blocks = _handoff(sched, "a", 250)
    assert blocks is not None
    _, refused = _handoff(sched, "b", 250)
    assert refused is None
    assert "b" not in sched.requests
    check_integrity(sched)


def test_a_handoff_without_its_first_token_is_refused():
    # A one-token prompt's KV table came out empty, detached from the request's plans.
    sched = make(num_blocks=16, engine_type="completion", max_model_len=256)
    with pytest.raises(ValueError, match="the first token its prompt engine sampled"):
        sched.admit_handoff(Request("a", [5]), [])
    assert "a" not in sched.requests
    check_integrity(sched)
