"""vLLM's calls of the offline API run unchanged: prompt dicts (text or token ids, with
a cache salt) mixed in a list, max_tokens=None, chat's tools and chat_template, use_tqdm;
what it has no use for is refused by name."""

from __future__ import annotations

import pytest

from tandem.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def llm(smollm2):
    # SmolLM2's tokenizer: text prompts need one; 64 tokens of context for max_tokens=None.
    return LLM(smollm2, num_kv_blocks=64, max_model_len=64)


def test_prompt_dicts_generate_as_text_and_token_ids_do(llm):
    text = "The capital of France is"
    [plain] = llm.generate([text], GREEDY)
    outs = llm.generate(
        [{"prompt": text}, {"prompt_token_ids": plain.prompt_token_ids}, text], GREEDY
    )
    assert [out.token_ids for out in outs] == [plain.token_ids] * 3  # in order, each alike
    assert [out.prompt for out in outs] == [text, None, text]
    [alone] = llm.generate({"prompt_token_ids": plain.prompt_token_ids}, GREEDY)
    assert alone.token_ids == plain.token_ids


def test_a_cache_salt_keeps_prefix_hits_among_prompts_of_the_same_salt(llm):
    ids = list(range(100, 140))  # 40 tokens: two full blocks of 16 to share
    llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, GREEDY)
    [other] = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-b"}, GREEDY)
    [same] = llm.generate({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, GREEDY)
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 32


def test_max_tokens_none_generates_until_the_context_ends(llm):
    endless = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": [1, 2, 3]}, endless)
    assert len(out.token_ids) == 64 - 3 and out.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        ({"prompt": "hi", "multi_modal_data": {}}, "'multi_modal_data' is not supported: "),
        ({"prompt_embeds": [[0.1]]}, "'prompt_embeds' is not supported: give text or token"),
        ({"prompt": "hi", "lora": 1}, "unknown prompt key 'lora': a prompt dict has 'prompt'"),
        (
            {"prompt": "hi", "prompt_token_ids": [1]},
            "a prompt dict has one of 'prompt' or 'prompt_token_ids'",
        ),
        ({}, "a prompt dict has one of 'prompt' or 'prompt_token_ids'"),
        ({"prompt": [1, 2]}, r"'prompt' must be a string \(token ids go in"),
        ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' is a list of token ids"),
        ({"prompt": "hi", "cache_salt": 7}, "cache_salt must be a string"),
    ],
)
def test_a_prompt_dict_this_engine_cannot_read_is_refused_by_name(llm, prompt, says):
    with pytest.raises(ValueError, match=says):
        llm.generate(prompt, GREEDY)
    with pytest.raises(ValueError, match="prompt 1: " + says):  # which one, in a list
        llm.generate(["fine", prompt], GREEDY)


def test_prompts_and_prompt_token_ids_together_or_neither_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one of prompts or prompt_token_ids"):
        llm.generate("hi", GREEDY, prompt_token_ids=[[1]])
    with pytest.raises(ValueError, match="exactly one of prompts or prompt_token_ids"):
        llm.generate(sampling_params=GREEDY)
    with pytest.raises(ValueError, match="a string, a prompt dict or a list of them"):
        llm.generate(7, GREEDY)


# Writes what the tests look for: each message's content, then how many tools.
COUNTING_TOOLS = "{% for m in messages %}{{ m.content }}{% endfor %}|tools:{{ tools | length }}"


def test_chat_renders_with_the_template_and_tools_given(llm):
    hello = [{"role": "user", "content": "Hello"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    [out] = llm.chat(hello, GREEDY, tools=tools, chat_template=COUNTING_TOOLS, use_tqdm=False)
    assert llm.tokenizer.decode(out.prompt_token_ids) == "Hello|tools:1"
    # chat_template_kwargs' own tools win, as vLLM merges them.
    kwargs = {"tools": tools * 2}
    [out] = llm.chat(
        hello, GREEDY, tools=tools, chat_template=COUNTING_TOOLS, chat_template_kwargs=kwargs
    )
    assert llm.tokenizer.decode(out.prompt_token_ids) == "Hello|tools:2"
    # The checkpoint's own template again without one given.
    [own] = llm.chat(hello, GREEDY)
    assert own.prompt_token_ids[0] == llm.tokenizer.encode("<|im_start|>")[0]


def test_a_chat_template_that_does_not_compile_is_named(llm):
    with pytest.raises(ValueError, match="given chat template does not compile"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template="{% if %}")
    with pytest.raises(ValueError, match="chat_template must be a Jinja template"):
        llm.chat([{"role": "user", "content": "Hi"}], GREEDY, chat_template="")


def test_a_progress_bar_is_taken_and_a_lora_adapter_refused(llm):
    [out] = llm.generate("Hi", GREEDY, use_tqdm=False)
    assert out.token_ids
    for call in (
        lambda: llm.generate("Hi", GREEDY, lora_request=object()),
        lambda: llm.chat([{"role": "user", "content": "Hi"}], GREEDY, lora_request=object()),
    ):
        with pytest.raises(ValueError, match="lora_request: this engine serves no LoRA"):
            call()
