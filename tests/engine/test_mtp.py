"""MTP heads: the runner hands a head the right hidden states, keeps its draft
distributions for the step that verifies them, and the output distribution stays
the target model's. (Greedy equality with HF under an MTP head is in
test_llm_matches_hf.py.)"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from support.mtp_heads import SuccessorHead

from tandem.engine import LLM, SamplingParams
from tandem.engine.model.loader import load_model
from tandem.engine.mtp import MtpDrafting, MtpDrafts
from tandem.engine.sample_rows import SampleRows

ALPHA = 1e-3
HOT = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


class NoisyBigramHead:
    """Samples each draft from q(. | the token before it): 0.6 on a likely successor,
    0.3 on a token the target never emits, the rest spread over the vocabulary. q
    differs between sequences (it follows their tokens), so a q handed to the wrong
    row or depth would bias what the sampler emits."""

    def __init__(self, vocab: int, likely: dict[int, int], never: int) -> None:
        self.vocab, self.likely, self.never = vocab, likely, never
        self.generator = torch.Generator().manual_seed(5)

    def q(self, previous: int) -> torch.Tensor:
        q = torch.full((self.vocab,), 0.1 / self.vocab)
        q[self.likely.get(previous, 0)] += 0.6
        q[self.never] += 0.3
        return q

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, num_drafts: int) -> MtpDrafts:
        drafts, probs = [], []
        for token in tokens.tolist():
            row, row_q = [], []
            for _ in range(num_drafts):
                q = self.q(token)
                token = int(torch.multinomial(q, 1, generator=self.generator))
                row.append(token)
                row_q.append(q)
            drafts.append(row)
            probs.append(torch.stack(row_q))
        return MtpDrafts(torch.tensor(drafts), torch.stack(probs))


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", dtype="float32", device="cpu")


def _samples(llm: LLM, prompt: list[int], seeds: range) -> list[tuple[int, ...]]:
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
        for s in seeds
    ]
    outputs = llm.generate(prompt_token_ids=[prompt] * len(params), sampling_params=params)
    return [tuple(o.token_ids) for o in outputs]


def test_sampled_drafts_keep_the_target_distribution(tiny):
    """Four sampled tokens (top-k 3: at most 81 outcomes) with and without an MTP head
    proposing two drafts a step from its own q (after the prefill's token, one decode
    step verifies both): the same distribution (a two-sample chi-square test), with
    drafts both accepted and rejected. A q handed to the wrong request or depth fails
    it (p < 1e-20)."""
    n, prompt = 3000, [7, 300, 41, 12]
    settings = dict(num_kv_blocks=1024, max_num_seqs=256, max_num_batched_tokens=1024)
    plain = _samples(LLM(tiny, **settings), prompt, range(n))
    # The head's likely successors are the commonest ones of the plain run.
    pairs = Counter((a, b) for t in plain for a, b in itertools.pairwise(t))
    likely = {}
    for (a, b), _ in pairs.most_common():
        likely.setdefault(a, b)
    emitted = {tok for t in plain for tok in t}
    never = next(tok for tok in range(tiny.config.vocab_size) if tok not in emitted)
    head = NoisyBigramHead(tiny.config.vocab_size, likely, never)
    llm = LLM(tiny, mtp_head=head, num_speculative_tokens=2, **settings)
    drafted = _samples(llm, prompt, range(n, 2 * n))

    totals = llm.engine.totals
    assert 0 < totals.drafts_accepted < totals.drafts_proposed
    assert never not in {tok for t in drafted for tok in t}  # p(never) = 0: always rejected
    outcomes = sorted(set(plain) | set(drafted))
    table = np.array([[Counter(run)[o] for o in outcomes] for run in (plain, drafted)])
    assert chi2_contingency(table).pvalue > ALPHA


class RecordingHead(SuccessorHead):
    """Drafts well enough to be accepted; records what the runner handed it."""

    def __init__(self, model: torch.nn.Module, references: list[list[int]]) -> None:
        super().__init__(references)
        self.model = model
        self.calls: list[tuple[list[int], list[int]]] = []  # (argmax of hidden, tokens)

    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, num_drafts: int) -> MtpDrafts:
        argmax = self.model.compute_logits(hidden).argmax(-1).tolist()
        self.calls.append((argmax, tokens.tolist()))
        return super().propose(hidden, tokens, num_drafts)


def test_the_head_gets_the_hidden_state_behind_each_new_token(tiny):
    """For greedy requests the new token is the argmax of the logits of the hidden
    state the head gets: the row after the last accepted draft, prefill or decode."""
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(tiny, num_kv_blocks=64).generate(prompt_token_ids=prompts, sampling_params=params)
    head = RecordingHead(tiny.model, [out.token_ids for out in plain])
    llm = LLM(tiny, mtp_head=head, num_speculative_tokens=3, num_kv_blocks=64)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert llm.engine.totals.drafts_accepted > 10  # the rows after accepted drafts were read
    assert len(head.calls) > 1
    for argmax, tokens in head.calls:
        assert argmax == tokens
    assert not llm.engine.runner.mtp._proposals  # nothing left behind


def _drafting(vocab: int = 8, k: int = 2) -> MtpDrafting:
    class Fixed:
        def __init__(self) -> None:
            self.out: MtpDrafts | None = None

        def propose(self, hidden, tokens, num_drafts):
            return self.out

    return MtpDrafting(Fixed(), k, vocab)


def test_draft_probs_are_laid_out_row_by_row():
    drafting = _drafting()
    q = torch.rand(3, 2, 8)
    q /= q.sum(-1, keepdim=True)
    drafting.head.out = MtpDrafts(torch.tensor([[1, 2], [3, 4], [5, 6]]), q)
    proposed = drafting.propose(["a", "b", "c"], torch.zeros(3, 4), [0, 0, 0])
    assert proposed == {"a": [1, 2], "b": [3, 4], "c": [5, 6]}
    rows = [
        SampleRows("a", 0, [1, 2], HOT, 4),  # both drafts verified: q rows 0, 1
        SampleRows("b", 3, [3, 4], GREEDY, 4),  # greedy: its rows are never read
        SampleRows("c", 6, [5], HOT, 4),  # trimmed by the scheduler: q's first row
        SampleRows("d", 8, [7, 7], HOT, 0),  # placeholders, no proposal: point masses (0)
        SampleRows("e", 11, [], HOT, 2),  # no drafts
    ]
    out = drafting.draft_probs(rows, 12)
    expected = torch.zeros(12, 8)
    expected[0:2] = q[0]
    expected[6] = q[2, 0]
    assert torch.allclose(out, expected)

    # The head's output was copied: a head may reuse its buffer.
    q.zero_()
    assert torch.allclose(drafting.draft_probs(rows, 12), expected)

    # Argmax drafts replace a request's distributions: its next drafts are point masses.
    drafting.head.out = MtpDrafts(torch.tensor([[1, 2]]))
    drafting.propose(["a"], torch.zeros(1, 4), [0])
    assert drafting.draft_probs(rows[:1], 2) is None
    drafting.free("c")
    assert drafting.draft_probs(rows[2:3], 8) is None


@pytest.mark.parametrize(
    ("out", "match"),
    [
        ([[1, 2]], "MtpDrafts"),
        (MtpDrafts(torch.tensor([1, 2])), r"integers \[1, 2\]"),
        (MtpDrafts(torch.tensor([[1.0, 2.0]])), "integers"),
        (MtpDrafts(torch.tensor([[1, 8]])), "outside the vocabulary of 8"),
        (MtpDrafts(torch.tensor([[1, 2]]), torch.rand(1, 2, 7)), r"float \[1, 2, 8\]"),
        (MtpDrafts(torch.tensor([[1, 2]]), torch.full((1, 2, 8), 0.5)), "summing to 1"),
        (MtpDrafts(torch.tensor([[1, 2]]), torch.eye(8)[[0, 2]].unsqueeze(0)), "give 0"),
        (MtpDrafts(torch.tensor([[1, 2]]), torch.full((1, 2, 8), 0.125) - 0.5), "non-negative"),
    ],
)
def test_what_a_head_returns_is_checked(out, match):
    drafting = _drafting()
    drafting.head.out = out
    with pytest.raises(ValueError, match=match):
        drafting.propose(["a"], torch.zeros(1, 4), [0])


def test_an_mtp_head_needs_speculative_tokens(tiny):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny, mtp_head=RecordingHead(tiny.model, []), num_kv_blocks=16)


def test_a_malformed_proposal_ends_its_requests_with_the_reason(tiny):
    class OutOfVocabulary:
        def propose(self, hidden, tokens, num_drafts):
            return MtpDrafts(torch.full((len(tokens), num_drafts), 10**6))

    llm = LLM(tiny, mtp_head=OutOfVocabulary(), num_speculative_tokens=2, num_kv_blocks=16)
    with pytest.raises(RuntimeError, match="outside the vocabulary of 512"):
        llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY)
    assert llm.engine.scheduler.kv_usage == 0
