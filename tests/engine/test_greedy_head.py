"""GreedyHead: greedy rows' tokens without the float32 logits, the float32 head's decision.

The screen (bfloat16 dot products and a rigorous error bound, csrc/greedy_head.cpp)
must never change a token: every case compares with the float32 head the engine
runs otherwise (panel_linear) and its argmax (argmax_rows), bit for bit, including
exact ties (the first maximum wins), near ties and rows holding NaN or infinity.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.engine import LLM, SamplingParams
from tandem.engine.model import cpu_kernels
from tandem.engine.model.greedy_head import GreedyHead
from tandem.engine.model.linear import Linear, pack_linears

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None or not cpu_kernels.has_bf16_dot(),
    reason="greedy_head runs on the C++ kernels built with AVX512-BF16, which this CPU lacks",
)
# Both screens where this CPU has AMX (the tiles, and vdpbf16ps's register tiles); the
# second alone where it has not.
_OPS = cpu_kernels.load()
SCREENS = (True, False) if _OPS is not None and _OPS.amx_ready() else (False,)


@pytest.fixture(params=SCREENS, ids=lambda tiles: "amx" if tiles else "vdpbf16ps")
def tiles(request) -> bool:
    return request.param


def screen(head: Linear, tiles: bool) -> GreedyHead:
    packed = GreedyHead.pack(head)
    assert packed is not None
    return dataclasses.replace(packed, tiles=tiles)


def head_of(vocab: int, hidden: int, seed: int = 0) -> Linear:
    head = Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    pack_linears(head)  # the float32 panels, which the screen reads for exact logits
    return head


def float32_tokens(head: Linear, x: torch.Tensor) -> torch.Tensor:
    """What the engine samples without the screen: panel_linear's logits, argmax_rows."""
    ops = cpu_kernels.load()
    vocab = head.weight.shape[0]
    logits = ops.panel_linear(x, ops.pack_panels(head.weight), vocab, None, False)
    return ops.argmax_rows(logits)


@pytest.mark.parametrize(
    ("vocab", "hidden"),
    [(49152, 576), (1000, 64), (1003, 65), (50, 7), (47, 1)],  # partial panels, odd k
)
@pytest.mark.parametrize("rows", [1, 5, 17, 64])
def test_the_screen_picks_the_float32_head_s_token(vocab, hidden, rows, tiles):
    head = head_of(vocab, hidden)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)) * 3
    assert torch.equal(screen(head, tiles)(x), float32_tokens(head, x))


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_the_screens_split_over_threads(tiles, threads):
    # The engine runs the screen on every thread, each with its own panels (and, on AMX,
    # its own tile configuration).
    head = head_of(49152, 576)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(3)) * 3
    assert torch.equal(screen(head, tiles)(x), float32_tokens(head, x))


def test_the_head_screens_on_amx_where_this_process_may():
    assert GreedyHead.pack(head_of(100, 8)).tiles == _OPS.amx_ready()


def test_ties_and_near_ties_go_to_the_float32_head_s_first_maximum(tiles):
    head = head_of(2000, 96)
    with torch.no_grad():
        w = head.weight
        w[700] = w[30]  # an exact tie: token 30 must win
        w[31] = w[30] * (1 + 2**-20)  # a hair above: within the screen's error
        w[32] = w[30] * (1 - 2**-20)  # and below
    pack_linears(head)  # again: the packed copy does not follow the weight
    x = torch.cat([w[30:31] * 10, w[31:32] * -10, w[700:701] * 10])
    want = float32_tokens(head, x)
    assert torch.equal(screen(head, tiles)(x), want)
    assert want[0].item() in (30, 31)  # the case is a near tie indeed


def test_rows_that_share_candidate_panels_each_get_their_first_maximum(tiles, threads):
    # The exact step reads each candidate panel once for every row that wants it, four
    # rows a pass: nine rows on which tokens 30, 700 and 1500 tie exactly (panels 0, 14
    # and 31) must each get the first, 30, and rows pointing elsewhere their own.
    head = head_of(2000, 96)
    with torch.no_grad():
        w = head.weight
        w[700] = w[30]
        w[1500] = w[30]
    pack_linears(head)
    scales = torch.tensor([10.0, 7.0, 3.0, 12.0, 5.0, 4.0, 9.0, 2.0, 11.0])
    x = torch.cat([w[30:31] * scales[:, None], w[400:401] * 8, w[1999:2000] * 8])
    want = float32_tokens(head, x)
    assert torch.equal(screen(head, tiles)(x), want)
    assert want.tolist() == [30] * 9 + [400, 1999]


def test_a_token_bfloat16_rounding_puts_first_is_not_taken_on_the_screen_s_word(tiles):
    # Token 10's logit is the larger in float32 (2.00732 against 2.00024), but its
    # weights round down to bfloat16 and token 60's up (2.0 against 2.0039): only the
    # error bound keeps 10 in the running. (Different panels of 48 tokens: a panel
    # in the running is computed whole.)
    head = Linear(2, 100, bias=False)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[10] = torch.tensor([1 + 2**-8 - 2**-12] * 2)
        head.weight[60] = torch.tensor([1 + 2**-8 + 2**-12, 1 - 2**-8])
    pack_linears(head)
    x = torch.ones(1, 2)
    assert float32_tokens(head, x).item() == 10
    assert screen(head, tiles)(x).item() == 10


def test_rows_with_nan_or_infinity_follow_argmax_s_rule(tiles):
    head = head_of(300, 40)
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] = 1e36  # |x| |w| past where float32 sums might overflow: no screen
    assert torch.equal(screen(head, tiles)(x), float32_tokens(head, x))


def _unguarded(head: Linear, tiles: bool) -> GreedyHead:
    """The screen of a head that GreedyHead.pack refuses: the kernel's own guards."""
    ops = cpu_kernels.load()
    w = head.weight.detach()
    norms = torch.linalg.vector_norm(w.double(), dim=1).float()
    return GreedyHead(ops.pack_bf16_panels(w), head.packed.data, norms, tiles)


def test_a_head_with_nan_is_not_screened_and_the_kernel_would_compute_it_whole(tiles):
    # A corrupt checkpoint: the float32 head's argmax is the first NaN logit.
    for nan_at in (3, 70):
        head = head_of(200, 16)
        with torch.no_grad():
            head.weight[nan_at, 5] = float("nan")
        pack_linears(head)
        assert GreedyHead.pack(head) is None
        x = torch.randn(9, 16, generator=torch.Generator().manual_seed(nan_at))
        assert torch.equal(_unguarded(head, tiles)(x), float32_tokens(head, x))


def test_values_bfloat16_cannot_hold_are_not_screened(tiles):
    # From 2^127 on, a float32 rounds to an infinite bfloat16. Tiny weights keep
    # |x| |w| under the overflow guard; the screen would then see inf * 0 = NaN for the
    # argmax (token 60) and +inf for token 0.
    head = Linear(2, 96, bias=False)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[:, 0] = -1e-10
        head.weight[0] = torch.tensor([1e-37, 0.0])
        head.weight[60] = torch.tensor([0.0, 1e-10])
    pack_linears(head)
    x = torch.tensor([[3.4e38, 1e30], [1.0, 2.0]])
    assert float32_tokens(head, x)[0].item() == 60
    assert torch.equal(screen(head, tiles)(x), float32_tokens(head, x))
    big = head_of(100, 8)
    with torch.no_grad():
        big.weight[7, 0] = 3.4e38
    pack_linears(big)
    assert GreedyHead.pack(big) is None


def test_a_head_it_cannot_screen_is_not_packed():
    biased = Linear(8, 16, bias=True)
    pack_linears(biased)
    assert GreedyHead.pack(biased) is None  # a bias: not an LM head
    assert GreedyHead.pack(Linear(8, 16)) is None  # not on the panel kernel
    half = Linear(8, 16).to(torch.bfloat16)
    pack_linears(half)
    assert GreedyHead.pack(half) is None  # bfloat16 runs on oneDNN


def test_greedy_generation_is_the_same_with_and_without_the_screen(monkeypatch):
    llm = LLM("random:small", max_model_len=256, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert model.greedy_head is not None
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    calls = []
    screened_head = model.greedy_head
    monkeypatch.setattr(model, "greedy_head", _Counting(screened_head, calls))
    screened = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert calls  # the steps took the screen
    monkeypatch.setattr(model, "greedy_head", None)
    plain = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert screened == plain


def test_a_mixed_step_screens_its_greedy_rows_and_samples_the_others(monkeypatch):
    llm = LLM("random:small", max_model_len=256, num_kv_blocks=64)
    model = llm.engine.runner.model
    prompts = [[(5 * i + 2 * j) % 700 + 1 for j in range(4 + 2 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seeded = [
        SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)
    ]
    params = [greedy, seeded[0], greedy, seeded[1], greedy, seeded[2]]
    calls: list[int] = []
    monkeypatch.setattr(model, "greedy_head", _Counting(model.greedy_head, calls))
    screened = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert calls and max(calls) == 3  # the three greedy rows, never the sampled ones
    monkeypatch.setattr(model, "greedy_head", None)
    plain = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert screened == plain  # seeded draws depend on the request, not on the batch


class _Counting:
    def __init__(self, head: GreedyHead, calls: list[int]) -> None:
        self.head, self.calls = head, calls

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        return self.head(hidden)
