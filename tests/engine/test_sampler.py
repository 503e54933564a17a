"""Sampler: greedy verification, exact output distribution, seeds, filters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.engine.draws import filtered_probs, inverse_cdf
from tandem.engine.plan import ScheduledSeq, StepPlan
from tandem.engine.request import SamplingParams
from tandem.engine.sample_rows import SampleRows, rows_for_plan
from tandem.engine.sampler import Sampler, _argmax

GREEDY = SamplingParams(temperature=0.0)
# Chi-square p-values below this fail; every draw is seeded, so runs are repeatable.
ALPHA = 1e-3


def one_hot_logits(winners: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(winners), vocab)
    logits[torch.arange(len(winners)), torch.tensor(winners)] = 5.0
    return logits


def reference_probs(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float):
    """The target distribution, written independently of the sampler."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    mass = 0.0
    for token in order:
        if mass >= top_p:
            p[token] = 0.0
        mass += p[token] if keep[token] else 0.0
    return p / p.sum()


# --------------------------------------------------------------- greedy


def test_greedy_accepts_matching_prefix_then_corrects():
    sampler = Sampler()
    logits = one_hot_logits([3, 4, 1, 7])
    rows = [SampleRows("a", 0, [3, 4, 5], GREEDY, 0)]
    assert sampler.sample(logits, rows) == [[3, 4, 1]]


def test_greedy_bonus_token_after_all_drafts_accepted():
    sampler = Sampler()
    logits = one_hot_logits([3, 4, 7])
    assert sampler.sample(logits, [SampleRows("a", 0, [3, 4], GREEDY, 0)]) == [[3, 4, 7]]


def test_greedy_first_draft_rejected_and_no_drafts():
    sampler = Sampler()
    logits = one_hot_logits([2, 4, 6, 1])
    rows = [SampleRows("a", 0, [5, 4], GREEDY, 0), SampleRows("b", 3, [], GREEDY, 9)]
    assert sampler.sample(logits, rows) == [[2], [1]]


def test_greedy_rows_among_random_rows():
    sampler = Sampler()
    logits = one_hot_logits([1, 2, 3, 4, 5])
    hot = SamplingParams(temperature=1.0, top_k=1)  # random path, but only one token left
    rows = [
        SampleRows("a", 0, [1], hot, 0),
        SampleRows("b", 2, [3], GREEDY, 0),
        SampleRows("c", 4, [], hot, 0),
    ]
    assert sampler.sample(logits, rows) == [[1, 2], [3, 4], [5]]


def test_argmax_tokens_verify_drafts_as_the_logits_do():
    # The greedy head gives each row's argmax, not the logits: the same verdicts.
    sampler = Sampler()
    winners = [3, 4, 1, 7, 2, 6]
    rows = [SampleRows("a", 0, [3, 4, 5], GREEDY, 0), SampleRows("b", 4, [2], GREEDY, 0)]
    want = sampler.sample(one_hot_logits(winners), rows)
    assert sampler.accept_greedy(winners, rows) == want == [[3, 4, 1], [2, 6]]


def test_argmax_tokens_are_refused_for_a_row_that_samples_or_is_missing():
    sampler = Sampler()
    with pytest.raises(ValueError, match="needs its logits"):
        sampler.accept_greedy([1], [SampleRows("a", 0, [], SamplingParams(temperature=0.7), 0)])
    with pytest.raises(ValueError, match="needs its logits"):
        penalized = SamplingParams(temperature=0.0, presence_penalty=0.5)
        sampler.accept_greedy([1], [SampleRows("a", 0, [], penalized, 0)])
    with pytest.raises(ValueError, match=r"owns rows \[0, 3\) of 2 argmax tokens"):
        sampler.accept_greedy([1, 2], [SampleRows("a", 0, [5, 6], GREEDY, 0)])


def test_greedy_argmax_is_torch_argmax_ties_nan_and_infinities_included():
    # float32 CPU logits take the C++ kernel where it builds; the rule is torch's.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 1000, generator=gen)
    logits[1, [10, 700]] = 9.0  # a tie: the first index
    logits[2, 999] = 9.0  # the last element
    logits[3, [5, 600]] = float("nan")  # NaN counts as the maximum, the first one
    logits[4, :] = float("-inf")
    logits[5, 17] = float("inf")
    logits[6, 40:] = float("-inf")  # masked tail beside finite values
    logits[7, :64] = -1.0  # the maximum sits past the first 64-wide chunk
    logits[7, 64:] = -2.0
    logits[7, 300] = -0.5
    for view in (logits, logits[:, ::2], logits[::3]):
        assert torch.equal(_argmax(view), view.argmax(-1)), view.shape


def test_never_more_than_one_plus_drafts_and_drafts_are_a_prefix():
    sampler = Sampler(seed=3)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4 * 50, 5, generator=gen)
    params = SamplingParams(temperature=1.0)
    rows = [SampleRows(str(i), 4 * i, [i % 5, 2, 3], params, 0) for i in range(50)]
    for row, tokens in zip(rows, sampler.sample(logits, rows), strict=True):
        assert 1 <= len(tokens) <= 4
        assert tokens[:-1] == row.drafts[: len(tokens) - 1]


def test_bad_input_is_refused():
    sampler = Sampler()
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="rows"):
        sampler.sample(logits, [SampleRows("a", 1, [1], GREEDY, 0)])
    with pytest.raises(ValueError, match="float"):
        sampler.sample(torch.zeros(2, 4, dtype=torch.long), [])
    with pytest.raises(ValueError, match="draft_probs"):
        sampler.sample(logits, [], draft_probs=torch.zeros(3, 4))
    hot = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="vocabulary"):
        sampler.sample(logits, [SampleRows("a", 0, [9], hot, 0)], draft_probs=torch.ones(2, 4))


def test_rows_for_plan_packs_sampled_sequences():
    def seq(rid, fed, sample, drafts, num_output):
        return ScheduledSeq(
            request_id=rid,
            token_ids=fed,
            start_pos=0,
            block_ids=[],
            sample=sample,
            draft_token_ids=drafts,
            sampling_params=SamplingParams(),
            num_output_tokens=num_output,
            all_token_ids=[0, *fed],
        )

    plan = StepPlan(
        is_prefill=False,
        seqs=[
            seq("a", [5, 6, 7], True, [6, 7], 3),
            seq("b", [1, 2], False, [], 0),  # a mid-prompt chunk
            seq("c", [9], True, [], 1),
        ],
    )
    rows = rows_for_plan(plan)
    assert [(r.request_id, r.start, r.drafts, r.num_generated) for r in rows] == [
        ("a", 0, [6, 7], 3),
        ("c", 3, [], 1),
    ]


# ---------------------------------------------------------- distribution

TARGETS = [
    # (row logits, temperature, top_k, top_p)
    ([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], 1.0, None, 1.0),
    ([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], 0.7, 3, 1.0),
    ([1.0, 0.2, -0.5, 2.0, 0.0, -1.5], 1.3, None, 0.8),
    ([0.5, 1.5, -0.5, 1.0, 0.8, 0.1], 0.9, 4, 0.7),
]
ROW1 = [0.3, -1.0, 1.2, 0.0, 0.9, -0.3]


def emitted_pairs(sampler, first, second, drafts, params, n, draft_q=None):
    """First and second emitted tokens of n identical sequences (two steps where needed)."""
    rows_per_seq = 1 + len(drafts[0])
    # Row 0 predicts the first token; every later row (context-free here) the second.
    logits = torch.tensor([first, second, second][:rows_per_seq]).repeat(n, 1)
    rows = [SampleRows(str(i), rows_per_seq * i, d, params, 0) for i, d in enumerate(drafts)]
    probs = None
    if draft_q is not None:
        probs = torch.tensor(draft_q).repeat(n, 1, 1)[:, :rows_per_seq].reshape(-1, 6)
    out = sampler.sample(logits, rows, draft_probs=probs)
    short = [i for i, tokens in enumerate(out) if len(tokens) < 2]
    again = [SampleRows(str(i), j, [], params, 1) for j, i in enumerate(short)]
    more = sampler.sample(torch.tensor([second] * len(short)), again)
    for i, tokens in zip(short, more, strict=True):
        out[i] = out[i] + tokens
    return np.array([tokens[:2] for tokens in out])


def assert_distribution(observed: np.ndarray, expected: np.ndarray) -> None:
    counts = np.bincount(observed, minlength=len(expected))
    assert counts[expected == 0].sum() == 0, "a filtered-out token was emitted"
    nonzero = expected > 0
    f_exp = expected[nonzero] * len(observed)
    assert chisquare(counts[nonzero], f_exp).pvalue > ALPHA


@pytest.mark.parametrize(("logits", "temperature", "top_k", "top_p"), TARGETS)
@pytest.mark.parametrize("draft0", [3, 5])
def test_point_mass_drafts_emit_the_target_distribution(logits, temperature, top_k, top_p, draft0):
    n = 20_000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    pairs = emitted_pairs(Sampler(seed=1), logits, ROW1, [[draft0, 2]] * n, params, n)
    p0 = reference_probs(np.array(logits), temperature, top_k, top_p)
    p1 = reference_probs(np.array(ROW1), temperature, top_k, top_p)
    assert_distribution(pairs[:, 0], p0)
    assert_distribution(pairs[:, 0] * 6 + pairs[:, 1], np.outer(p0, p1).ravel())


@pytest.mark.parametrize(("logits", "temperature", "top_k", "top_p"), TARGETS[1:])
def test_general_proposal_emits_the_target_distribution(logits, temperature, top_k, top_p):
    n = 20_000
    # q puts mass where p has none (filtered tokens) and differs from p elsewhere.
    q0 = np.array([0.05, 0.3, 0.25, 0.1, 0.2, 0.1])
    q1 = np.array([0.4, 0.1, 0.1, 0.1, 0.2, 0.1])
    rng = np.random.default_rng(7)
    drafts = np.stack([rng.choice(6, n, p=q0), rng.choice(6, n, p=q1)], axis=1).tolist()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    draft_q = [q0.tolist(), q1.tolist(), [1 / 6] * 6]
    pairs = emitted_pairs(Sampler(seed=2), logits, ROW1, drafts, params, n, draft_q)
    p0 = reference_probs(np.array(logits), temperature, top_k, top_p)
    p1 = reference_probs(np.array(ROW1), temperature, top_k, top_p)
    assert_distribution(pairs[:, 0], p0)
    assert_distribution(pairs[:, 0] * 6 + pairs[:, 1], np.outer(p0, p1).ravel())


def test_seeded_draws_follow_the_target_distribution():
    # One sequence per seed: the hashed uniforms must be as good as the generator's.
    n = 20_000
    logits, temperature, top_k, top_p = TARGETS[3]
    kwargs = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    rows = [SampleRows(str(i), 2 * i, [1], SamplingParams(**kwargs, seed=i), 5) for i in range(n)]
    out = Sampler().sample(torch.tensor([logits, ROW1] * n), rows)
    first = np.array([tokens[0] for tokens in out])
    assert_distribution(first, reference_probs(np.array(logits), temperature, top_k, top_p))


# -------------------------------------------------------- reproducibility


def seeded_tokens(batch: list[tuple[list[float], SamplingParams]], drafts=(), num_generated=0):
    """Tokens for the first sequence of a batch; the others fill it with noise."""
    logits = []
    rows = []
    for i, (row, params) in enumerate(batch):
        d = list(drafts) if i == 0 else []
        rows.append(SampleRows(str(i), len(logits), d, params, num_generated))
        logits.extend([row] * (1 + len(d)))
    return Sampler(seed=len(batch)).sample(torch.tensor(logits), rows)[0]


def test_same_seed_same_tokens_whatever_the_batch():
    flat = [0.0] * 50
    params = SamplingParams(temperature=1.0, seed=1234)
    others = [
        (flat, SamplingParams(temperature=1.0)),
        (flat, GREEDY),
        (flat, SamplingParams(temperature=0.5, seed=99, top_k=3)),
    ]
    for step in range(5):
        alone = seeded_tokens([(flat, params)], num_generated=step)
        assert seeded_tokens([(flat, params), *others], num_generated=step) == alone
        assert seeded_tokens([(flat, params), *others[::-1]], num_generated=step) == alone


def test_seeded_tokens_do_not_depend_on_speculation():
    # Drafts only decide how many tokens come out at once, never which.
    flat = [0.0] * 5
    params = SamplingParams(temperature=1.0, seed=77)
    one_by_one = [seeded_tokens([(flat, params)], num_generated=t)[0] for t in range(4)]
    for drafts in ([], one_by_one[:3], [one_by_one[0], 4, 4], [4, 4, 4]):
        out = seeded_tokens([(flat, params)], drafts=drafts)
        assert out == one_by_one[: len(out)]


def test_different_seeds_differ_and_positions_differ():
    flat = [0.0] * 1000
    tokens = {
        seed: [
            seeded_tokens([(flat, SamplingParams(temperature=1.0, seed=seed))], num_generated=t)[0]
            for t in range(8)
        ]
        for seed in (0, 1, 2**63 + 5, -5)
    }
    assert len({tuple(t) for t in tokens.values()}) == 4
    assert len(set(tokens[0])) > 4


def test_unseeded_draws_follow_the_sampler_seed():
    logits = torch.zeros(20, 1000)
    rows = [SampleRows(str(i), i, [], SamplingParams(temperature=1.0), 0) for i in range(20)]
    assert Sampler(seed=5).sample(logits, rows) == Sampler(seed=5).sample(logits, rows)
    assert Sampler(seed=5).sample(logits, rows) != Sampler(seed=6).sample(logits, rows)
    # None: each sampler seeded from the OS (engine replicas, seeded alike, gave the same
    # "random" answers in turn).
    assert Sampler(seed=None).sample(logits, rows) != Sampler(seed=None).sample(logits, rows)


# --------------------------------------------------------------- filters


def test_top_k_keeps_the_k_largest_and_ties_at_the_cutoff():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [1.0, 2.0, 2.0, 0.0, 2.0]])
    probs = filtered_probs(logits.clone(), [2, 2], [1.0, 1.0])
    assert (probs > 0).tolist() == [
        [False, True, False, True, False],
        [False, True, True, False, True],  # three tied at the 2nd largest: all stay
    ]


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]] * 3))
    probs = filtered_probs(logits.clone(), [5, 5, 5], [0.5, 0.6, 0.8])
    assert (probs > 0).sum(-1).tolist() == [1, 2, 3]


def test_top_p_applies_to_the_renormalised_top_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top-2 renormalised: 4/7, 3/7; top_p 0.6 needs both.
    assert (filtered_probs(logits.clone(), [2], [0.6]) > 0).tolist() == [[True, True, False, False]]


def test_top_p_cutoff_beyond_the_candidates_sorts_that_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2000, generator=gen) * 0.1  # flat: 0.9 of the mass is ~1800 tokens
    probs = filtered_probs(logits.clone(), [2000, 2000, 5], [0.9, 0.999, 0.9])
    for row, (top_k, top_p) in enumerate([(None, 0.9), (None, 0.999), (5, 0.9)]):
        expected = reference_probs(logits[row].double().numpy(), 1.0, top_k, top_p) > 0
        assert ((probs[row] > 0).numpy() == expected).all()


def test_inverse_cdf_is_exact_on_an_even_grid():
    # Evenly spaced uniforms must land on each token N * p times, give or take one.
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(768, generator=gen) ** 4  # three blocks of 256
    probs[:3] = 0  # zeros at the start, the end and across block edges
    probs[-5:] = 0
    probs[250:260] = 0
    probs[500:520] = 0
    n = 200_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    picks = inverse_cdf(probs.expand(n, -1), u)
    counts = torch.bincount(picks, minlength=768).double()
    expected = probs.double() / probs.double().sum() * n
    assert (counts - expected).abs().max() <= 1.0 + 1e-6
    assert counts[probs == 0].sum() == 0


def test_inverse_cdf_extremes_never_pick_zero_probability():
    probs = torch.zeros(3, 700)  # padded to three blocks of 256
    probs[:, 300] = 1.0
    probs[:, 650] = 1e-10
    # u = 1 is out of range, but x = u * total rounding up to total must end the same way.
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [300, 650, 650]


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    # 5e-324 is a valid top_p (0 < p <= 1) that is 0.0 in float32.
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0]])
    params = SamplingParams(temperature=1.0, top_p=5e-324, seed=3)
    rows = [SampleRows("r", 0, [], params, 0)]
    assert Sampler(0).sample(logits, rows) == [[1]]


def test_a_row_of_zeros_in_draft_probs_is_a_point_mass_draft():
    """A seeded request's tokens do not depend on other rows of its batch having a q."""
    first, second = TARGETS[0][0], ROW1
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed)
        row = SampleRows("a", 0, [3], params, 0)
        alone = Sampler().sample(torch.tensor([first, second]), [row])
        q = torch.zeros(4, 6)
        q[2] = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])  # the other request's draft
        rows = [SampleRows("a", 0, [3], params, 0), SampleRows("b", 2, [1], params, 0)]
        batched = Sampler().sample(torch.tensor([first, second, first, second]), rows, q)
        assert batched[0] == alone[0]


@pytest.mark.parametrize("temperature", [1e-300, 1e-46, 1e-38, 1e-30, 1e-8])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature):
    # The logits over a tiny temperature overflowed float32 into NaN probabilities,
    # which picked the vocabulary's last token every step; below float32's smallest
    # number (1e-46) the temperature itself rounded to 0 and divided into NaN.
    row = [3.0, 9.5, -2.0, 9.0, 0.5, 7.0]
    for seed in (None, 0, 7):
        params = SamplingParams(temperature=temperature, seed=seed)
        for step in range(3):
            assert seeded_tokens([(row, params)], num_generated=step) == [1]


def test_an_overflowed_logit_is_the_likeliest_and_a_nan_none():
    # inf - inf was NaN: the row drew the vocabulary's last token, greedy the inf one.
    inf, nan = float("inf"), float("nan")
    params = SamplingParams(temperature=1.0, seed=3)
    assert seeded_tokens([([1.0, inf, 2.0, 0.5], params)]) == [1]
    with_nan = [5.0, nan, 4.0, -1.0]
    draws = {
        seeded_tokens([(with_nan, SamplingParams(temperature=1.0, seed=seed))])[0]
        for seed in range(40)
    }
    assert 1 not in draws and draws & {0, 2}  # it drew the last token, 3, every time


def test_a_vocabulary_smaller_than_the_logprobs_asked_gives_them_all():
    # topk past the vocabulary failed the whole step, the requests beside it too.
    from tandem.engine.logprobs import token_logprobs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]]))
    rows = [
        SampleRows("a", 0, [], SamplingParams(temperature=0, logprobs=20), 0),
        SampleRows("b", 1, [], GREEDY, 0),
    ]
    got = token_logprobs(logits, rows, [[0], [1]])
    [entry] = got["a"]
    assert [token for token, _ in entry.top] == [0, 1, 2]
    assert entry.logprob == pytest.approx(np.log(0.5), abs=1e-6)
    assert "b" not in got
