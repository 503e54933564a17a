"""The step scheduler's speculative decoding: drafts proposed, verified, accepted."""

import pytest
from support.scheduler_integrity import check_integrity
from support.stepping import LONG, accept_all, fake_result, make, prompt, step

from tandem.engine.plan import StepResult
from tandem.engine.request import Request, RequestStatus, SamplingParams

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


def test_a_refused_result_changes_nothing_and_the_step_can_run_again():
    # Refused halfway, the first request's end was applied: it stayed in `running`
    # without its blocks, and no decode step ran again for anyone.
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), SamplingParams(max_tokens=1)))
    sched.add_request(Request("b", prompt(20), LONG))
    plan = sched.schedule()
    before = {rid: list(r.token_ids) for rid, r in sched.requests.items()}
    with pytest.raises(ValueError, match="'b': 4 drafts proposed"):
        sched.update(plan, StepResult({"a": [1], "b": [2]}, {"b": [1, 2, 3, 4]}))
    assert {rid: list(r.token_ids) for rid, r in sched.requests.items()} == before
    outputs = sched.update(plan, StepResult({"a": [1], "b": [2]}))  # the step, well answered
    assert [o.status for o in outputs] == [RequestStatus.FINISHED_LENGTH, RequestStatus.RUNNING]
    assert [r.request_id for r in sched.running] == ["b"] and list(sched.requests) == ["b"]
    check_integrity(sched)
    assert sched.schedule().seqs[0].request_id == "b"


def test_drafts_are_trimmed_to_the_tokens_left():
    sched = spec_sched()
    sched.add_request(Request("a", prompt(20), SamplingParams(max_tokens=3, ignore_eos=True)))
    step(sched)  # 1 token out, 2 left: at most 1 draft is worth verifying
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 2}
    outputs = sched.update(plan, fake_result(plan, accept_all))
    assert outputs[0].status is RequestStatus.FINISHED_LENGTH
    assert sched.requests == {}


def _two_prefilled(num_blocks: int, b_prompt: int):
    """The decode plan after a (6 prompt tokens) and b prefilled, blocks of 4 tokens,
    each with 4 placeholder drafts (no watermark: the pool may fill)."""
    sched = make(num_blocks, max_model_len=16, block_size=4, num_speculative_tokens=4,
                 vocab_size=100, cache_prefill_watermark=1.0)  # fmt: skip
    short = SamplingParams(max_tokens=8, ignore_eos=True)
    sched.add_request(Request("a", prompt(6), short))
    sched.add_request(Request("b", prompt(b_prompt, 50), short))
    step(sched)
    return sched.schedule()


def test_drafts_shrink_to_the_free_blocks_rather_than_preempt_a_request():
    plan = _two_prefilled(4, 6)  # two blocks each: the pool full
    # a's next token fits its second block; its placeholder drafts do not.
    assert not plan.preempted_request_ids
    assert plan.num_scheduled_tokens == {"a": 2, "b": 2}


def test_one_requests_drafts_never_take_the_block_anothers_next_token_needs():
    plan = _two_prefilled(5, 8)  # a holds 2 blocks, b 2 (full): one block free
    # b's next token (position 8) needs the free block; a's drafts must not take it.
    assert not plan.preempted_request_ids
    assert plan.num_scheduled_tokens["b"] >= 1 and set(plan.num_scheduled_tokens) == {"a", "b"}


def test_blocks_of_rejected_drafts_go_back_and_no_guess_preempts_later():
    # A's placeholder drafts took the last free block and kept it once rejected: the
    # next step preempted B for the block its own next token needed.
    def run(k: int) -> tuple[int, int]:
        sched = make(3, max_model_len=12, block_size=4, num_speculative_tokens=k,
                     vocab_size=64)  # fmt: skip
        sched.add_request(Request("a", [10], LONG))  # 1 block
        sched.add_request(Request("b", [20, 21, 22], LONG))  # 1 block, full after a token
        for _ in range(3):
            step(sched)  # every draft rejected: one new token each
        return sched.num_preemptions, len(sched.kv.block_table("a"))

    assert run(0) == (0, 1)
    assert run(3) == (0, 1)  # a keeps the block its tokens need, no more


def test_drafts_share_the_budget_left_once_every_sequence_has_its_token():
    sched = make(max_model_len=64, num_speculative_tokens=3, vocab_size=5000,
                 max_num_batched_tokens=8, enable_chunked_prefill=True)  # fmt: skip
    for i, rid in enumerate(("a", "b", "c")):
        sched.add_request(Request(rid, prompt(2, 100 * i), LONG))
    assert step(sched)[0].is_prefill  # all three: placeholders of 3 drafts each
    plan = sched.schedule()  # 3 next tokens, then 5 of the 9 drafts, oldest first
    assert plan.num_scheduled_tokens == {"a": 4, "b": 3, "c": 1}


def test_speculation_needs_the_vocab_size():
    with pytest.raises(ValueError, match="needs vocab_size"):
        make(max_model_len=512, num_speculative_tokens=2)


# ------------------------------------- drafts, stops and the prefix cache


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
