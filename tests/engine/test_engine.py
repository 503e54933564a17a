"""Engine and LLM on a small random model: text in, text out, stops, aborts, bad input."""

import pytest

from tandem.engine import LLM, SamplingParams
from tandem.engine.admission import ContextLengthError, PromptTooLongError
from tandem.engine.config import EngineConfig
from tandem.engine.llm import build_engine
from tandem.engine.request import RequestStatus
from tandem.engine.service.metrics import EngineMetrics


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", max_model_len=128, num_kv_blocks=64)


def test_generate_returns_outputs_in_order_with_text_and_tokens(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(["hello", "a longer prompt here", "x"], params)
    assert [o.prompt for o in outputs] == ["hello", "a longer prompt here", "x"]
    for out in outputs:
        assert len(out.token_ids) == 6
        assert out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)


def test_greedy_is_independent_of_batch_composition(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["the same prompt"], params)[0].token_ids
    together = llm.generate(["other", "the same prompt", "more text"], params)[1].token_ids
    assert alone == together


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    def run(seed, extra=()):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
        prompts = [*extra, "sampling"]
        return llm.generate(prompts, params)[-1].token_ids

    assert run(1) == run(1)
    assert run(1) == run(1, extra=("another request in the batch",))
    assert run(1) != run(2)


def test_stop_string_ends_the_request_and_is_cut_from_the_text(llm):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = llm.generate(["stop here"], params)[0]
    stop = free.text[5:7]  # a string the model is known to produce
    assert len(stop) == 2
    stopped = llm.generate(["stop here"], SamplingParams(**{**vars_of(params), "stop": (stop,)}))
    out = stopped[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    assert llm.engine.scheduler.kv_usage == 0


def test_a_stop_string_the_last_allowed_token_completes_ends_as_a_stop(llm):
    # OpenAI's "stop": a stop sequence was met; "length" would tell a client the
    # answer was cut short and invite it to go on.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    free = llm.generate(["stop here"], params)[0]
    # The shortest ending of the text found nowhere before: met at the last token.
    text = free.text
    stop = next(text[-k:] for k in range(1, len(text)) if text.find(text[-k:]) == len(text) - k)
    out = llm.generate(["stop here"], SamplingParams(**{**vars_of(params), "stop": (stop,)}))[0]
    assert out.token_ids == free.token_ids
    assert out.text == text[: -len(stop)]
    assert out.finish_reason == "stop"


def test_the_choices_of_a_request_share_one_build_of_its_stop_strings(llm, monkeypatch):
    # Built on the thread that steps every request, linear in the strings' length: n
    # choices with four stops of ~250,000 characters stalled every stream 3-7 s.
    from tandem.engine import stop_matcher

    built = []
    real = stop_matcher._failure
    monkeypatch.setattr(stop_matcher, "_failure", lambda s: built.append(s) or real(s))
    stops = ("never " * 50, "nor this")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, stop=stops)
    outs = llm.generate(["one prompt"] * 4, params)
    assert sorted(built) == sorted(stops)  # once each, for the four choices
    assert all(len(o.token_ids) == 6 and o.finish_reason == "length" for o in outs)
    # Other strings get their own build; the stops still cut the text.
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = llm.generate(["stop here"], greedy)[0]
    cut = SamplingParams(**{**vars_of(greedy), "stop": (free.text[5:7],)})
    assert llm.generate(["stop here"], cut)[0].text == free.text[: free.text.index(cut.stop[0])]
    assert built[2:] == [cut.stop[0]]


def test_speculation_stops_where_a_stop_string_completes(llm):
    """Drafts accepted after the token that completes a stop string are dropped: token
    ids, text, reason and accepted-draft counts match a run without speculation."""
    drafted = LLM(llm.loaded, max_model_len=128, num_kv_blocks=64, num_speculative_tokens=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # Greedy falls into a loop; a prompt already inside it gets its drafts accepted at once.
    (start,) = llm.generate(["abc"], params)
    prompt = llm.tokenizer.encode("abc") + start.token_ids
    cut_short = 0
    for at in range(1, 13):
        stop = start.text[-at - 2 : -at]
        with_stop = SamplingParams(**{**vars_of(params), "stop": (stop,)})
        before = drafted.engine.totals.drafts_accepted
        ours, plain = both_runs(drafted, llm, prompt, with_stop)
        accepted = drafted.engine.totals.drafts_accepted - before
        assert accepted < len(ours.token_ids)  # counts only the drafts kept
        cut_short += accepted > 0
        # A stop token id drafted right after the token that completes the string: the
        # plain run never sampled it, so it is no more in token_ids than the drafts are.
        if len(plain.token_ids) == params.max_tokens:
            continue  # the string never completed
        (going_on,) = llm.generate(prompt_token_ids=[prompt], sampling_params=params)
        after = going_on.token_ids[len(plain.token_ids)]
        both = SamplingParams(**{**vars_of(with_stop), "stop_token_ids": (after,), "logprobs": 0})
        ours, _ = both_runs(drafted, llm, prompt, both)
        assert len(ours.logprobs) == len(ours.token_ids)
    assert cut_short  # drafts were accepted on the way to a stop


def both_runs(drafted, plain_llm, prompt, params):
    """(drafted's output, plain's) for one prompt, checked to say the same."""
    ours = drafted.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    plain = plain_llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    assert (ours.token_ids, ours.text, ours.finish_reason) == (
        plain.token_ids,
        plain.text,
        plain.finish_reason,
    )
    return ours, plain


def vars_of(params):
    return {f: getattr(params, f) for f in params.__dataclass_fields__}


def test_abort_frees_the_kv_cache_at_once(llm):
    engine = llm.engine
    engine.add_request("a", "abort me", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.scheduler.kv_usage > 0
    out = engine.abort("a")
    assert out.finish_reason == "abort"
    assert engine.scheduler.kv_usage == 0
    assert engine.abort("a") is None


def test_a_prompt_over_the_limit_is_a_clear_error(llm):
    with pytest.raises(
        PromptTooLongError, match="has 200 tokens, more than the 127 that leave room"
    ):
        llm.generate(prompt_token_ids=[[1] * 200])
    assert not llm.engine.has_unfinished_requests()


def test_a_prompt_must_leave_the_context_room_for_one_token(llm):
    # A prompt filling the context would answer a token past it: usage over the context.
    context = llm.engine.config.max_model_len
    with pytest.raises(PromptTooLongError, match=f"has {context} tokens"):
        llm.generate(prompt_token_ids=[[1] * context])
    [out] = llm.generate(prompt_token_ids=[[1] * (context - 1)])
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_an_exact_max_tokens_must_fit_in_the_context_a_default_is_cut(llm):
    engine, params = llm.engine, SamplingParams(max_tokens=30, ignore_eos=True)
    with pytest.raises(ContextLengthError, match=r"requested 130 tokens \(100 in the prompt, 30"):
        engine.add_request("a", None, params, prompt_token_ids=[1] * 100, exact_max_tokens=True)
    with pytest.raises(PromptTooLongError):  # too long on its own: that error, not this one
        engine.add_request("b", None, params, prompt_token_ids=[1] * 200, exact_max_tokens=True)
    assert not engine.has_unfinished_requests()
    engine.add_request("c", None, params, prompt_token_ids=[1] * 98, exact_max_tokens=True)
    engine.abort("c")
    # Without it, generation runs to the end of the context and finishes with "length".
    [out] = llm.generate(prompt_token_ids=[[1] * 100], sampling_params=params)
    assert len(out.token_ids) == 28 and out.finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_token_ids": [[1, 512]]}, "outside the vocabulary"),
        ({"prompt_token_ids": [[1, -3]]}, "non-negative integers"),
        ({"prompt_token_ids": [[]]}, "the prompt is empty"),
        ({}, "exactly one of prompts or prompt_token_ids"),
    ],
)
def test_bad_prompts_are_clear_errors(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(**kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_prompt_in_a_batch_is_named_by_its_index(llm):
    with pytest.raises(
        PromptTooLongError,
        match=r"^prompt 2: This model's maximum context length is 128 tokens\. .* has 200 tokens",
    ):
        llm.generate(prompt_token_ids=[[1, 2], [3], [1] * 200])
    with pytest.raises(ValueError, match=r"^prompt 1: prompt token id 512 is outside"):
        llm.generate(prompt_token_ids=[[1], [512]])
    assert not llm.engine.has_unfinished_requests()  # the prompts before it are aborted


def test_max_tokens_below_one_is_refused():
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/no/such/model", "no such file or directory"),
        ("random:enormous", "random"),
    ],
)
def test_unknown_models_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(spec)


@pytest.mark.parametrize("pool", [{"num_kv_blocks": 10**11}, {"kv_cache_memory": 10**16}])
def test_a_kv_cache_larger_than_the_machine_is_named_before_the_weights_load(pool, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded first (minutes, for a big model)")

    monkeypatch.setattr("tandem.engine.model.loader.LlamaForCausalLM", never)
    with pytest.raises(ValueError, match=r"KV cache \(.* GiB\) cannot fit this cpu device's"):
        LLM("random:tiny", **pool)


def test_engine_settings_are_checked_before_the_model_loads():
    # A path that does not exist: an error about it would mean it was loaded first.
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        LLM("/no/such/model", block_size=0)  # was a ZeroDivisionError sizing the KV pool


def test_a_context_past_the_models_positions_is_refused():
    # random:tiny has 2,048 positions; past them the model was never trained.
    with pytest.raises(ValueError, match=r"max_model_len \(4096\) is longer than the model's 2048"):
        LLM("random:tiny", max_model_len=4096, num_kv_blocks=512)
    assert (
        LLM("random:tiny", max_model_len=2048, num_kv_blocks=160).engine.config.max_model_len
        == 2048
    )


def test_unknown_engine_settings_are_refused():
    with pytest.raises(ValueError, match="unknown engine settings: max_seqs"):
        LLM("random:tiny", max_seqs=4)


def test_chat_renders_the_checkpoint_template_and_answers(llm):
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(max_tokens=3))
    rendered = llm.tokenizer.apply_chat_template(messages)
    assert rendered.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert out[0].prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(out[0].token_ids) == 3


def test_chat_can_go_on_with_an_assistant_answer_begun(llm):
    # The prompt ends inside the assistant's turn, as vLLM's continue_final_message: the
    # model completes "The capital is" rather than answering after a closed turn.
    begun = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The capital is "}]
    out = llm.chat(begun, SamplingParams(max_tokens=2),
                   add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    closed = llm.tokenizer.apply_chat_template(begun, add_generation_prompt=False)
    assert closed.endswith("The capital is <|im_end|>\n")
    expected = closed[: closed.rindex("<|im_end|>")]
    assert out[0].prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    # As vLLM merges them, chat_template_kwargs may set the options too, and wins.
    merged = llm.chat(begun, SamplingParams(max_tokens=2),
                      chat_template_kwargs={"add_generation_prompt": False,
                                            "continue_final_message": True})  # fmt: skip
    assert merged[0].prompt_token_ids == out[0].prompt_token_ids
    # Without the generation prompt, the conversation's turns are closed.
    named = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                     add_generation_prompt=False)  # fmt: skip
    assert llm.tokenizer.decode(named[0].prompt_token_ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    refusals = {
        "exclude each other": {"continue_final_message": True},
        "continue_final_message must be True or False": {
            "add_generation_prompt": False,
            "continue_final_message": "yes",
        },
        "chat_template_kwargs must be a dict": {"chat_template_kwargs": ["x"]},
        "chat_template_kwargs cannot set messages": {"chat_template_kwargs": {"messages": []}},
        # A client's Jinja in the model's stead (a work item's kwargs reach here too).
        "chat_template_kwargs cannot set chat_template": {
            "chat_template_kwargs": {"chat_template": "{% for i in range(9**9) %}{% endfor %}"}
        },
    }
    for why, options in refusals.items():
        with pytest.raises(ValueError, match=why):
            llm.chat(begun, SamplingParams(max_tokens=1), **options)
    # An answer begun with nothing but a space goes on from the space (transformers too).
    blank = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
                     SamplingParams(max_tokens=1),
                     add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    assert llm.tokenizer.decode(blank[0].prompt_token_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n "
    )


def test_engine_outputs_stream_deltas_that_add_up_to_the_text(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine.add_request("s", "stream", params)
    deltas, tokens, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.text_delta)
            tokens.extend(out.new_token_ids)
            final = out
    assert final.finished and final.finish_reason == RequestStatus.FINISHED_LENGTH.value
    assert len(tokens) == final.num_output_tokens == 10
    assert "".join(deltas) == llm.tokenizer.decode(tokens)


def _resume(llm, prompt_ids, generated, max_tokens):
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(
        "r", None, params, prompt_token_ids=prompt_ids, generated_token_ids=generated
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_a_resumed_request_already_at_the_contexts_end_samples_nothing(llm):
    # Its last engine died after sending the token that filled the context (128).
    outputs = _resume(llm, [5] * 100, [7] * 28, max_tokens=500)
    [final] = outputs
    assert final.finished and final.finish_reason == "length" and final.new_token_ids == []


def test_a_resumed_request_ending_on_a_stop_token_ends_as_a_stop(llm):
    params = SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=(9,))
    llm.engine.add_request("s", None, params, prompt_token_ids=[5] * 10, generated_token_ids=[9])
    [final] = llm.engine.step()
    assert final.finished and final.finish_reason == "stop" and final.new_token_ids == []


def test_a_step_that_raises_ends_its_requests_not_the_engine(llm, monkeypatch):
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("doomed", "x", params)
    engine.step()  # its prefill, a step that ran

    def broken(plan):
        raise RuntimeError("kernel exploded")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "execute", broken)
        (out,) = engine.step()
    assert out.finish_reason == "error" and "kernel exploded" in out.error
    assert not engine.has_unfinished_requests() and engine.scheduler.kv_usage == 0
    # Nothing was computed: no step to count (the metrics counted the step before it
    # again, its time too, so that a failing engine read busy and productive).
    assert engine.last_step.num_seqs == 0
    metrics = EngineMetrics("tiny", "normal")
    metrics.observe_step(engine)
    labels = {"model": "tiny", "role": "normal"}
    assert metrics.registry.get_sample_value("tandem_engine_step_seconds_count", labels) == 0
    # The engine goes on serving.
    assert len(llm.generate(["after"], params)[0].token_ids) == 4


def test_a_budget_set_alone_caps_the_derived_context_without_chunked_prefill():
    # A sequence must fit one step to be prefilled (again, after a preemption):
    # with no max_model_len given, the engine takes the budget's length, not an error.
    capped = LLM("random:tiny", num_kv_blocks=64, max_num_batched_tokens=96)
    assert capped.engine.scheduler.config.max_model_len == 96
    chunked = LLM(
        "random:tiny", num_kv_blocks=64, max_num_batched_tokens=96, enable_chunked_prefill=True
    )
    assert chunked.engine.scheduler.config.max_model_len == 64 * 16  # what the cache holds
    with pytest.raises(ValueError, match="smaller than max_model_len"):  # given, it is checked
        LLM("random:tiny", num_kv_blocks=64, max_num_batched_tokens=96, max_model_len=128)


def test_a_stop_token_ends_the_text_without_its_own(llm):
    # As vLLM: the stop id is the last of token_ids, its text is not in the answer
    # (a stop id that is an ordinary token, a newline say, would end every answer in it).
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = llm.generate(["stop on a token"], params)[0]
    stop_id = free.token_ids[4]
    cut = free.token_ids.index(stop_id)
    assert llm.tokenizer.decode([stop_id]), "the stop token must have text of its own"
    stopped = llm.generate(
        ["stop on a token"], SamplingParams(**{**vars_of(params), "stop_token_ids": (stop_id,)})
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: cut + 1]
    assert stopped.text == llm.tokenizer.decode(free.token_ids[:cut])


def test_a_decoder_drafts_from_a_handoff_at_once_and_a_prompt_engine_not_at_all(llm):
    # A COMPLETION engine's first step verified placeholders after every handoff, never
    # right (one token where a local prefill's n-gram drafts gave up to 1 + k); a PROMPT
    # engine indexed every prompt, held while its KV waited, and never drafted.
    loaded = llm.loaded
    fields = {"num_speculative_tokens": 4, "vocab_size": loaded.config.vocab_size}
    fields["max_model_len"] = 256
    decoder = build_engine(loaded, EngineConfig(engine_type="completion", **fields), 64, seed=0)
    loop = [7, 8, 9, 10, 11] * 6  # what the n-gram drafter reads at once
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    decoder.admit_handoff("h", loop, [7], greedy)
    decoder.handoff_received("h")  # (no KV written: only the plan is read here)
    assert decoder.scheduler.schedule().seqs[0].draft_token_ids == [8, 9, 10, 11]
    prompts = build_engine(loaded, EngineConfig(engine_type="prompt", **fields), 64, seed=0)
    assert prompts.runner.drafter is None
