"""Presence and frequency penalties and logit_bias on a step's logits
(logit_adjustments.py), and how the sampler and the plan's rows carry them. That
Tandem's greedy output under them equals HF's generate with the same adjustments:
test_llm_matches_hf.py."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.logit_adjustments import adjust_logits
from tandem.engine.plan import ScheduledSeq, StepPlan
from tandem.engine.request import SamplingParams
from tandem.engine.sample_rows import SampleRows, rows_for_plan
from tandem.engine.sampler import Sampler

VOCAB = 10


def reference(logits: torch.Tensor, row: int, output: list[int], presence, frequency):
    """OpenAI's definition, token by token."""
    want = logits[row].clone()
    for token in set(output):
        want[token] -= presence + frequency * output.count(token)
    return want


def test_each_row_is_penalized_by_the_output_before_it_drafts_included():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    output = [3, 3, 7]
    rows = [
        SampleRows("plain", 0, [], SamplingParams(), 2, output),  # no penalty: untouched
        SampleRows("drafting", 1, [7, 2, 3], params, 3, output),
        SampleRows("first token", 5, [], params, 0, ()),
    ]
    original = logits.clone()
    got = adjust_logits(logits, rows)
    assert torch.equal(logits, original)  # the step's logits are left as they were
    assert torch.equal(got[0], logits[0])
    drafts = [7, 2, 3]
    for j in range(4):  # row j follows the output and drafts[:j]
        want = reference(logits, 1 + j, output + drafts[:j], 0.5, 0.25)
        torch.testing.assert_close(got[1 + j], want)
    assert torch.equal(got[5], logits[5])  # nothing generated yet: nothing to penalize


def test_negative_penalties_raise_the_tokens_and_no_penalty_is_no_copy():
    logits = torch.zeros(1, VOCAB)
    raised = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)
    got = adjust_logits(logits, [SampleRows("a", 0, [], raised, 2, [4, 4])])
    assert got[0, 4] == 2.0 and got[0].sum() == 2.0
    unpenalized = [SampleRows("a", 0, [], SamplingParams(), 2, [4, 4])]
    assert adjust_logits(logits, unpenalized) is logits


def test_a_token_outside_the_vocabulary_is_refused():
    params = SamplingParams(frequency_penalty=1.0)
    with pytest.raises(ValueError, match="outside the vocabulary of 10"):
        adjust_logits(torch.zeros(1, VOCAB), [SampleRows("a", 0, [], params, 1, [VOCAB])])
    biased = SamplingParams(logit_bias={VOCAB: 1.0})
    with pytest.raises(ValueError, match="logit_bias token id is outside the vocabulary of 10"):
        adjust_logits(torch.zeros(1, VOCAB), [SampleRows("a", 0, [], biased, 0)])


def test_the_bias_is_added_on_every_row_of_its_request_after_the_penalties():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(frequency_penalty=1.0, logit_bias={1: -100, 6: 2.5})
    rows = [SampleRows("a", 0, [6, 1], params, 1, [6]), SampleRows("b", 3, [], SamplingParams(), 0)]
    got = adjust_logits(logits, rows)
    for j, output in enumerate(([6], [6, 6], [6, 6, 1])):
        want = reference(logits, j, output, 0.0, 1.0)
        want[1] -= 100
        want[6] += 2.5
        torch.testing.assert_close(got[j], want)
    assert torch.equal(got[3], logits[3])


def test_a_bias_of_minus_100_bans_the_greedy_choice_and_100_forces_one():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    sample = Sampler().sample
    banned = SamplingParams(temperature=0.0, logit_bias={0: -100})
    assert sample(logits, [SampleRows("a", 0, [], banned, 0)]) == [[1]]
    forced = SamplingParams(temperature=1.0, seed=3, logit_bias={3: 100})
    assert all(sample(logits, [SampleRows("a", 0, [], forced, p)]) == [[3]] for p in range(20))


def test_a_greedy_penalized_row_takes_the_argmax_after_the_penalties():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 2)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    # Token 0 appeared twice: 5 - 1.2 < 4, so token 1 wins; a draft of 0 is rejected.
    assert Sampler().sample(logits, [SampleRows("a", 0, [0], params, 2, [0, 0])]) == [[1]]
    # Once: 5 - 0.6 > 4, the draft 0 is accepted, and its row after counts it twice.
    assert Sampler().sample(logits, [SampleRows("a", 0, [0], params, 1, [0])]) == [[0, 1]]


def test_penalties_apply_before_temperature_and_the_seeded_draw():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    output = [2, 2, 5, 9]
    penalized = SamplingParams(
        temperature=0.8, seed=11, presence_penalty=1.2, frequency_penalty=0.4
    )
    plain = SamplingParams(temperature=0.8, seed=11)
    for position in range(40):  # different draws of the same seed
        got = Sampler().sample(logits, [SampleRows("a", 0, [], penalized, position, output)])
        by_hand = reference(logits, 0, output, 1.2, 0.4).unsqueeze(0)
        want = Sampler().sample(by_hand, [SampleRows("a", 0, [], plain, position)])
        assert got == want


def test_the_plan_rows_carry_the_output_of_penalized_requests_only():
    def seq(rid, params, tokens, generated):
        return ScheduledSeq(
            request_id=rid,
            token_ids=tokens[-1:],
            start_pos=len(tokens) - 1,
            block_ids=[0],
            sample=True,
            draft_token_ids=[],
            sampling_params=params,
            num_output_tokens=generated,
            all_token_ids=tokens,
        )

    tokens = [1, 2, 3, 8, 9]  # a prompt of 3, an output of 2
    plan = StepPlan(
        seqs=[
            seq("penalized", SamplingParams(presence_penalty=0.1), tokens, 2),
            seq("plain", SamplingParams(), tokens, 2),
        ],
        is_prefill=False,
    )
    penalized, plain = rows_for_plan(plan)
    assert list(penalized.output_token_ids) == [8, 9] and plain.output_token_ids == ()


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({5: 100.5}, r"logit_bias of token 5 must be in \[-100, 100\]"),
        ({5: float("nan")}, r"logit_bias of token 5 must be in \[-100, 100\]"),
        ({-1: 1.0}, "logit_bias keys must be token ids"),
        ({"5": 1.0}, "logit_bias keys must be token ids"),
        ([(5, 1.0), (5, 2.0)], "logit_bias gives token 5 twice"),
        ([(5,)], "logit_bias must map token ids to biases"),
        (7, "logit_bias must map token ids to biases"),
    ],
)
def test_a_bad_logit_bias_is_refused_naming_the_problem(bias, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_a_logit_bias_is_kept_as_sorted_pairs_from_a_mapping_or_pairs():
    want = ((2, -1.0), (9, 3.0))
    assert SamplingParams(logit_bias={9: 3, 2: -1.0}).logit_bias == want
    assert SamplingParams(logit_bias=[[9, 3.0], [2, -1]]).logit_bias == want


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -2.01, float("nan"), float("inf"), True, "1"])
def test_a_penalty_outside_minus_two_to_two_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a number in \\[-2, 2\\]"):
        SamplingParams(**{name: value})


def test_which_requests_need_their_logits():
    assert not SamplingParams(temperature=0.0).needs_logits
    assert SamplingParams(temperature=0.0, frequency_penalty=0.1).needs_logits
    assert SamplingParams(temperature=0.0, logit_bias={3: 1.0}).needs_logits
    assert SamplingParams(temperature=0.7).needs_logits
