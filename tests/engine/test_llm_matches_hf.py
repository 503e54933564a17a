"""Greedy outputs equal Hugging Face transformers' greedy generate, token for token.

Random Llama configs saved with save_pretrained (GQA ratios 1 and 4, tied and
untied embeddings, an odd vocabulary), loaded by Tandem from the directory,
under every scheduler path that touches the KV cache: mixed prompt lengths in
one batch, chunked prefill, prefix-cache hits, preemption forced by a tiny KV
pool, and speculative decoding (n-gram drafts, and an MTP head's).
transformers is a test-only dependency.
"""

import functools
import random

import pytest
import torch
import transformers
from support.mtp_heads import SuccessorHead

from tandem.engine import LLM, SamplingParams

SHAPES = {
    # name: (hidden, heads, kv_heads, layers, vocab, tied)
    "mha-tied-odd-vocab": (64, 4, 4, 2, 397, True),
    "gqa4-untied": (64, 8, 2, 2, 512, False),
}
MAX_NEW = 24


def _save_random_llama(path, hidden, heads, kv_heads, layers, vocab, tied):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        rope_theta=10_000.0,
        # Peaked logits: with std 0.02 a random model's logits are near ties, and
        # argmax would hinge on the last bit of float rounding.
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    """(make_llm, hf): make_llm(**settings) is Tandem's LLM over the saved directory, in
    float32 on --engine-device; hf is transformers' model on the CPU, the reference."""
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_random_llama(path, *SHAPES[request.param])
    device = request.config.getoption("--engine-device")
    return functools.partial(LLM, str(path), device=device, dtype="float32"), hf


def _prompts(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _hf_greedy(hf, prompt, max_new=MAX_NEW, processors=()):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList(processors),
        )
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _tandem(make_llm, prompts, **settings):
    settings.setdefault("num_kv_blocks", 256)
    llm = make_llm(max_model_len=256, **settings)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    return [o.token_ids for o in outputs], llm


# Decode steps eager, or padded to CUDA graphs' shapes (decode_graphs.py): recorded
# and replayed with --engine-device cuda, run unrecorded on the CPU.
GRAPHS = pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])


@GRAPHS
def test_batch_of_mixed_prompt_lengths(checkpoint, graphs):
    make_llm, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [1, 7, 33, 80])
    ours, _ = _tandem(make_llm, prompts, decode_graphs=graphs)
    assert ours == [_hf_greedy(hf, p) for p in prompts]


def test_decode_graphs_as_the_batch_shrinks_and_contexts_grow(checkpoint):
    """Sequences finishing one after another take the batch down through the graphs'
    row counts, and growing contexts take it up through their widths."""
    make_llm, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [3, 12, 9, 1, 5, 6], seed=9)
    lengths = [2, 5, 9, 14, 20, 30]
    llm = make_llm(max_model_len=256, num_kv_blocks=256, block_size=4, decode_graphs=True)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    want = [_hf_greedy(hf, p, max_new=n) for p, n in zip(prompts, lengths, strict=True)]
    assert [o.token_ids for o in outputs] == want
    shapes = llm.engine.runner.decode_graphs.shapes
    assert {rows for rows, _, _ in shapes} == {1, 2, 4, 8}
    assert len({width for _, _, width in shapes}) > 2


def test_chunked_prefill(checkpoint):
    make_llm, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [150, 41], seed=1)
    ours, _ = _tandem(make_llm, prompts, enable_chunked_prefill=True, max_num_batched_tokens=64)
    assert ours == [_hf_greedy(hf, p) for p in prompts]


def test_prefix_cache_hits(checkpoint):
    make_llm, hf = checkpoint
    (shared,) = _prompts(hf.config.vocab_size, [70], seed=2)
    llm = make_llm(max_model_len=256, num_kv_blocks=256)
    first = llm.generate(prompt_token_ids=[[*shared, 5]], sampling_params=GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(prompt_token_ids=[[*shared, 9, 9]], sampling_params=GREEDY)[0]
    assert second.num_cached_tokens == 64  # four full blocks of 16 reused
    assert second.token_ids == _hf_greedy(hf, [*shared, 9, 9])


def test_prompts_of_one_step_share_their_prefix(checkpoint):
    # n choices of a prompt and a burst with a common prefix, prefilled in one step:
    # the later ones read the blocks the first fills in that same step.
    make_llm, hf = checkpoint
    (shared,) = _prompts(hf.config.vocab_size, [70], seed=4)
    prompts = [[*shared, 5], [*shared, 5], [*shared, 9, 9]]
    llm = make_llm(max_model_len=256, num_kv_blocks=256)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [0, 64, 64]
    assert [o.token_ids for o in outputs] == [_hf_greedy(hf, p) for p in prompts]


@GRAPHS
def test_preemption_forced_by_a_tiny_kv_pool(checkpoint, graphs):
    make_llm, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [30, 20, 25, 18], seed=3)
    llm = make_llm(max_model_len=64, num_kv_blocks=8, block_size=8, decode_graphs=graphs)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [_hf_greedy(hf, p) for p in prompts]


@GRAPHS
def test_ngram_speculative_decoding(checkpoint, graphs):
    make_llm, hf = checkpoint
    # Repetitive prompts give the n-gram drafter something to find.
    base = _prompts(hf.config.vocab_size, [6, 5], seed=4)
    prompts = [b * 6 for b in base]
    ours, llm = _tandem(make_llm, prompts, num_speculative_tokens=3, decode_graphs=graphs)
    assert ours == [_hf_greedy(hf, p) for p in prompts]
    totals = llm.engine.totals
    assert totals.drafts_proposed > 0  # speculation really ran
    assert totals.drafts_accepted <= totals.drafts_proposed
    if graphs:  # steps verifying drafts ran padded to 1 + 3 rows a sequence
        assert 4 in {queries for _, queries, _ in llm.engine.runner.decode_graphs.shapes}


@GRAPHS
def test_mtp_head_speculative_decoding(checkpoint, graphs):
    make_llm, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [9, 30], seed=5)
    expected = [_hf_greedy(hf, p) for p in prompts]
    head = SuccessorHead(expected)  # drafts what followed each token in HF's output
    ours, llm = _tandem(
        make_llm, prompts, num_speculative_tokens=3, mtp_head=head, decode_graphs=graphs
    )
    assert ours == expected
    totals = llm.engine.totals
    assert 0 < totals.drafts_accepted < totals.drafts_proposed
    if graphs:
        assert 4 in {queries for _, queries, _ in llm.engine.runner.decode_graphs.shapes}


class _OpenAIAdjustments(transformers.LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens generated so far, and
    its logit_bias, as a logits processor for HF's generate: the reference Tandem's
    sampler must match."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency
        self.bias = bias

    def __call__(self, input_ids, scores):
        for row, ids in enumerate(input_ids[:, self.prompt_len :].tolist()):
            for token in set(ids):
                scores[row, token] -= self.presence + self.frequency * ids.count(token)
            for token, value in self.bias.items():
                scores[row, token] += value
        return scores


@pytest.mark.parametrize("drafts", [0, 3], ids=["plain", "ngram-drafts"])
def test_penalized_and_biased_greedy_matches_hf_with_the_same_adjustments(checkpoint, drafts):
    """Greedy rows with penalties or a bias leave the greedy head for the logits and the
    sampler; the penalties count the output only, and a draft row counts the drafts
    before it."""
    make_llm, hf = checkpoint
    base = _prompts(hf.config.vocab_size, [5, 4, 6, 5], seed=6)
    prompts = [b * 5 for b in base]  # repetitive: the n-gram drafter finds drafts
    # (presence, frequency, bias) a prompt; the last bans plain greedy's first token.
    first = _hf_greedy(hf, prompts[3], max_new=1)[0]
    adjustments = [
        (0.0, 1.5, {}),
        (2.0, 0.0, {}),
        (-0.5, 0.7, {}),
        (0.0, 0.0, {first: -100.0, 3: 2.0}),
    ]
    llm = make_llm(max_model_len=256, num_kv_blocks=256, num_speculative_tokens=drafts)
    changed = []
    for prompt, (presence, frequency, bias) in zip(prompts, adjustments, strict=True):
        params = SamplingParams(
            max_tokens=MAX_NEW,
            temperature=0.0,
            ignore_eos=True,
            presence_penalty=presence,
            frequency_penalty=frequency,
            logit_bias=bias,
        )
        ours = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
        reference = _OpenAIAdjustments(len(prompt), presence, frequency, bias)
        assert ours == _hf_greedy(hf, prompt, processors=[reference]), (presence, frequency, bias)
        changed.append(ours != _hf_greedy(hf, prompt))
    assert any(changed[:3]) and changed[3]  # the adjustments bite
    if drafts:
        assert llm.engine.totals.drafts_proposed > 0


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.0, logprobs=5),
        dict(temperature=0.0, logprobs=3, frequency_penalty=1.0, logit_bias={7: 3.0}),
        dict(temperature=0.9, seed=4, top_k=20, logprobs=0),
    ],
    ids=["greedy", "adjusted", "sampled"],
)
def test_logprobs_are_the_models_own_at_each_generated_position(checkpoint, settings):
    """Each token's logprob, and its position's most likely tokens, equal HF's
    log_softmax over the whole output fed back in one forward: the raw model's,
    whatever the penalties, bias and temperature; and the same for drafts accepted
    (an MTP head drafting the output the engine gave without speculation)."""
    make_llm, hf = checkpoint
    prompts = _prompts(hf.config.vocab_size, [5, 30], seed=8)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, **settings)
    plain = make_llm(max_model_len=256, num_kv_blocks=256).generate(
        prompt_token_ids=prompts, sampling_params=params
    )
    head = SuccessorHead([out.token_ids for out in plain])
    llm = make_llm(max_model_len=256, num_kv_blocks=256, num_speculative_tokens=3, mtp_head=head)
    drafted = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.engine.totals.drafts_accepted > 0
    for prompt, ours, again in zip(prompts, plain, drafted, strict=True):
        assert again.token_ids == ours.token_ids
        assert len(ours.logprobs) == len(again.logprobs) == len(ours.token_ids) == MAX_NEW
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours.token_ids])).logits[0]
        want = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)
        entries = [*enumerate(ours.logprobs), *enumerate(again.logprobs)]
        for position, entry in entries:
            row, token = want[position], ours.token_ids[position]
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert len(entry.top) == params.logprobs
            top_values, _ = row.topk(params.logprobs)
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
            for token_id, value in entry.top:  # ties may order alike values either way
                assert value == pytest.approx(float(row[token_id]), abs=1e-4)


def test_logprobs_are_none_unless_asked_and_a_bad_count_is_refused(checkpoint):
    make_llm, _ = checkpoint
    llm = make_llm(max_model_len=64, num_kv_blocks=16)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    assert llm.generate(prompt_token_ids=[[1, 2]], sampling_params=plain)[0].logprobs is None
    for bad in (-1, 21, True, 2.0):
        with pytest.raises(ValueError, match="logprobs must be an integer in \\[0, 20\\]"):
            SamplingParams(logprobs=bad)


def test_logit_bias_and_stop_token_ids_outside_the_vocabulary_are_refused(checkpoint):
    make_llm, hf = checkpoint
    llm = make_llm(max_model_len=64, num_kv_blocks=16)
    vocab = hf.config.vocab_size
    bad = SamplingParams(max_tokens=2, logit_bias={vocab: 1.0})
    with pytest.raises(ValueError, match=f"logit_bias token id {vocab} is outside the vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=bad)
    # A stop id no step can sample: another tokenizer's id, a mistake to name.
    bad = SamplingParams(max_tokens=2, stop_token_ids=[3, vocab + 5])
    with pytest.raises(ValueError, match=f"stop_token_ids \\[{vocab + 5}\\] are outside the vocab"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=bad)


# ------------------------------------------------------------ SmolLM2 (GGUF)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    """transformers' Llama with the weights Tandem reads from the GGUF."""
    source = smollm2.source
    # No EOS: min_new_tokens would otherwise mask it out, and Tandem's ignore_eos
    # keeps EOS possible (it only does not stop on it).
    config = transformers.LlamaConfig(
        **source.config.to_hf_dict(), bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(dict(source.iter_weights()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return source, hf


def test_smollm2_matches_hf_under_chunking_prefix_hits_preemption_and_speculation(
    smollm2, smollm2_hf
):
    source, hf = smollm2_hf
    questions = ["What is 2+2?", "Name a colour.", "Say hello in French.", "Count to five."]
    prompts = [source.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(
        smollm2,
        max_model_len=128,
        num_kv_blocks=10,  # 160 tokens for 4 sequences of ~50: preemption is forced
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,  # every prompt is chunked
        num_speculative_tokens=3,
    )
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    expected = [_hf_greedy(hf, p, max_new=16) for p in prompts]
    assert [o.token_ids for o in outputs] == expected
    totals = llm.engine.totals
    assert totals.preemptions > 0
    assert totals.prefix_cached_tokens > 0  # the shared system prompt
    assert totals.drafts_proposed > 0


def test_smollm2_answers_and_stops_at_its_end_of_turn_token(smollm2):
    llm = LLM(smollm2, max_model_len=256, num_kv_blocks=32)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=40, temperature=0.0),
    )[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # <|im_end|>, not max_tokens
    assert len(out.token_ids) < 40
