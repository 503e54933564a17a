"""The step scheduler's rules on one rank (docs/scheduler.md)."""

import pytest
from support.scheduler_integrity import check_integrity
from support.stepping import LONG, make, prompt, run_until_idle, step

from tandem.engine.admission import PromptTooLongError
from tandem.engine.request import Request, RequestStatus, SamplingParams
from tandem.engine.scheduler import MAX_PROMPT_STEPS_IN_A_ROW


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


def test_while_requests_decode_prompt_steps_run_eight_in_a_row_at_most():
    # Chained as a burst's are, a steady stream of short prompts (one arriving each
    # step, done at its first token) kept the running request from its next token for
    # good: every step a prompt step.
    sched = make(max_model_len=4096)
    start_long_decode(sched, 5)
    kinds = []
    for i in range(300):
        one = SamplingParams(max_tokens=1)
        sched.add_request(Request(f"q{i}", prompt(16, 30_000 + 20 * i), one))
        kinds.append("P" if step(sched)[0].is_prefill else "D")
    run = "".join(kinds)
    assert run[:65] == "D" * 65  # the first point, at 70
    assert max(len(p) for p in run.split("D")) == MAX_PROMPT_STEPS_IN_A_ROW
    assert "D" * 70 in run  # then the decode steps up to the next point
    assert sched.requests["long"].num_output_tokens >= 300 * 70 // 78 - 8


def test_with_chunked_prefill_a_stream_of_long_prompts_keeps_to_the_most_in_a_row():
    # Each prompt step finished a prompt mid-chunk and began the next with the budget
    # left: the first waiting prompt was always mid-chunk, exempt from the most in a
    # row, and the running request waited 96 prompt steps in a row.
    sched = make(max_model_len=4096, max_num_batched_tokens=64, enable_chunked_prefill=True)
    start_long_decode(sched, 0)
    kinds = []
    for i in range(300):
        if i % 3 != 2:  # two 97-token prompts every 3 steps: the budget's whole rate
            sched.add_request(Request(f"q{i}", prompt(97, 10_000 + 100 * i), LONG))
        kinds.append("P" if step(sched)[0].is_prefill else "D")
    runs = [len(p) for p in "".join(kinds).split("D")]
    # At the most, the prompt mid-chunk finishes (97 tokens: two chunks at most).
    assert max(runs) <= MAX_PROMPT_STEPS_IN_A_ROW + 2, runs
    assert sched.requests["long"].num_output_tokens >= 300 // (MAX_PROMPT_STEPS_IN_A_ROW + 3)


@pytest.mark.parametrize("engine_type", ["normal", "prompt"])
def test_past_the_most_in_a_row_with_nothing_decoding_a_step_takes_a_whole_burst(engine_type):
    # The cap read the running list as the step went: once its first prompt ran, the
    # step took no more, one prompt a step for good on a prompt engine (whose prompt
    # steps never end a run: it decodes nothing).
    sched = make(max_model_len=2048, engine_type=engine_type)
    admitted = []
    for i in range(12):
        for j in range(4):
            sched.add_request(Request(f"q{i}-{j}", prompt(16, 1000 * (4 * i + j)), LONG))
        admitted.append(len(step(sched)[0].num_scheduled_tokens))
        for rid in list(sched.handoff):  # a decoder fetched it
            sched.release_handoff(rid)
        for request in list(sched.running):
            sched.abort_request(request.request_id)  # done: nothing decodes
    assert admitted == [4] * 12


def test_a_burst_arriving_during_a_prompt_step_joins_the_run():
    # Requests a few milliseconds behind the first of a burst come during its prompt
    # step: they are prefilled next, not 70 decode steps later.
    sched = make(max_model_len=2048)
    start_long_decode(sched, 0)
    sched.add_request(Request("late", prompt(16, 7000), LONG))
    assert step(sched)[0].is_prefill


def test_with_nothing_decoding_every_arrival_is_prefilled_at_once():
    sched = make(max_model_len=2048)
    for i in range(12):  # past the most in a row: nothing waits on them
        sched.add_request(Request(f"q{i}", prompt(16, 1000 * i), SamplingParams(max_tokens=1)))
        assert step(sched)[0].is_prefill


def test_a_prompt_mid_chunk_finishes_whatever_the_run():
    # 40,000 tokens in chunks of 4,096: ten prompt steps in a row, past the most.
    sched = make(max_model_len=65_536, enable_chunked_prefill=True, max_num_batched_tokens=4096)
    start_long_decode(sched, 70)  # the next step is an attempt point
    sched.add_request(Request("long-prompt", prompt(40_000, 100_000), LONG))
    kinds = "".join("P" if step(sched)[0].is_prefill else "D" for _ in range(12))
    assert kinds == "P" * 10 + "DD"


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
    check_integrity(sched)


def test_a_prompt_step_admits_prompts_only_while_they_keep_usage_within_the_watermark():
    # Read once before the step, the watermark let one prompt step fill the pool, and the
    # next decode step preempted prompts it had just prefilled (their prefill wasted).
    sched = make(num_blocks=10, max_model_len=40, block_size=4, enable_prefix_caching=False)
    for i, n in enumerate([12, 12, 12, 4]):  # 3 + 3 + 3 + 1 blocks: the whole pool
        sched.add_request(Request(f"p{i}", prompt(n, 100 * i), SamplingParams(max_tokens=20)))
    plan, _ = step(sched)
    assert list(plan.num_scheduled_tokens) == ["p0", "p1", "p2"]  # 90 %: p3 would pass it
    assert sched.kv_usage == 0.9


def test_a_prompts_cached_blocks_nobody_holds_count_against_the_watermark():
    # Free until taken, they were left out: a prompt whose prefix was cached went in at
    # 0.96 (its uncached twin was refused) and the next decodes preempted it.
    sched = make(num_blocks=100, max_model_len=400, block_size=4)
    shared = prompt(160, 5000)
    sched.add_request(Request("a", shared, SamplingParams(max_tokens=1)))
    run_until_idle(sched)  # its 40 blocks stay cached, free
    long_run = SamplingParams(max_tokens=100, ignore_eos=True)
    sched.add_request(Request("r", prompt(219), long_run))
    step(sched)  # 55 blocks in use
    sched.add_request(Request("q", [*shared, 1, 2, 3, 4], long_run))  # 41 blocks, 40 cached
    plan, _ = step(sched)
    assert "q" not in plan.num_scheduled_tokens  # 0.55 + 0.41 would pass 0.90
    assert sched.kv_usage <= 0.9
    check_integrity(sched)


def test_a_prompt_that_lands_exactly_on_the_watermark_is_admitted():
    # 20 of 30 blocks in use and 7 more: 27/30 is 0.9, which a sum of two fractions
    # read as 0.9000000000000001 and refused.
    sched = make(num_blocks=30, max_model_len=120, block_size=4, enable_prefix_caching=False,
                 prefill_attempt_interval=1)  # fmt: skip
    long_run = SamplingParams(max_tokens=30, ignore_eos=True)
    sched.add_request(Request("r", prompt(79), long_run))
    step(sched)  # 20 blocks
    sched.add_request(Request("q", prompt(28, 1000), long_run))
    plan, _ = step(sched)
    assert "q" in plan.num_scheduled_tokens
    assert sched.kv_usage == 0.9


def test_a_prompt_larger_than_the_watermark_runs_when_nothing_else_does():
    sched = make(num_blocks=10, max_model_len=40, block_size=4)
    sched.add_request(Request("big", prompt(39), SamplingParams(max_tokens=1)))
    plan, _ = step(sched)  # all 10 blocks: the pool is idle otherwise
    assert plan.is_prefill and list(plan.num_scheduled_tokens) == ["big"]


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


def test_a_prompt_mid_chunk_past_the_watermark_lets_no_new_prompt_in_beside_it():
    sched = make(
        num_blocks=20,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=40,
        enable_chunked_prefill=True,
        cache_prefill_watermark=0.5,
        enable_prefix_caching=False,
    )
    long_run = SamplingParams(max_tokens=30, ignore_eos=True)
    sched.add_request(Request("a", prompt(50), long_run))
    step(sched)  # its first chunk: the whole prompt's blocks, 65 % of the pool
    assert sched.kv_usage > 0.5
    sched.add_request(Request("b", prompt(20, 100), long_run))
    plan, _ = step(sched)
    assert list(plan.num_scheduled_tokens) == ["a"], "b waits for usage to drop"
    check_integrity(sched)


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


def test_a_prompt_one_token_over_the_budget_left_is_chunked_or_waits():
    chunked = make(num_blocks=64, max_model_len=256, max_num_batched_tokens=64,
                   enable_chunked_prefill=True)  # fmt: skip
    chunked.add_request(Request("a", prompt(65, 1), SamplingParams(max_tokens=2)))
    assert chunked.schedule().num_scheduled_tokens == {"a": 64}
    whole = make(num_blocks=64, max_model_len=64, max_num_batched_tokens=64)
    whole.add_request(Request("a", prompt(40, 1), SamplingParams(max_tokens=2)))
    whole.add_request(Request("b", prompt(25, 100), SamplingParams(max_tokens=2)))
    assert whole.schedule().num_scheduled_tokens == {"a": 40}  # b's 25 > the 24 left


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
        PromptTooLongError, match=r"has 2049 tokens, more than the 2047 that leave room"
    ):
        sched.add_request(Request("long", prompt(2049)))
    assert not sched.has_unfinished_requests()
    assert "long" not in sched.requests


def test_decode_respects_the_budget():
    sched = make(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=100)
    for i in range(80):
        sched.add_request(Request(f"r{i}", prompt(4, i * 10), LONG))
    for _ in range(4):  # 16 prompts of 4 tokens a step
        assert step(sched)[0].is_prefill
    # As many running as a decode step holds: the other 16 wait unprefilled.
    assert sched.num_running == 64 and sched.num_waiting == 16
    plan, _ = step(sched)
    assert not plan.is_prefill
    assert plan.total_tokens == 64


def test_a_budget_below_max_num_seqs_never_leaves_a_started_answer_waiting():
    # Chunked prefill allows a budget below max_num_seqs. Each decode step took the
    # oldest sequences again: the newest, their first token sent, waited for the
    # oldest to finish (a stream that froze for minutes).
    sched = make(
        max_model_len=256, max_num_seqs=4, max_num_batched_tokens=2, enable_chunked_prefill=True
    )
    for i in range(4):
        sched.add_request(Request(f"r{i}", prompt(1, 10 + i), SamplingParams(max_tokens=50)))
    last: dict[str, int] = {}
    longest = 0
    for n in range(1000):
        if not sched.has_unfinished_requests():
            break
        _, outputs = step(sched)
        for out in outputs:
            if out.new_token_ids:
                longest = max(longest, n - last.get(out.request_id, n))
                last[out.request_id] = n
    assert not sched.has_unfinished_requests() and len(last) == 4
    assert longest <= 2  # a decode step, or a prompt step between two


def test_max_num_seqs_bounds_running_requests():
    sched = make(max_model_len=64, max_num_seqs=3)
    for i in range(5):
        sched.add_request(Request(f"r{i}", prompt(4, i * 10), LONG))
    plan, _ = step(sched)
    assert len(plan.seqs) == 3
    assert sched.num_running == 3 and sched.num_waiting == 2
