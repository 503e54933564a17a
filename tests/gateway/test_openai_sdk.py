"""The official `openai` package, unmodified, against a live gateway and a real engine."""

from __future__ import annotations

import openai
import pytest
from support.engines import Client

GREEDY = {"temperature": 0.0}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def sdk(shared_gateway):
    client = shared_gateway.openai()
    yield client
    client.close()


@pytest.fixture(scope="module")
def direct(redis_server, shared_keys, shared_gateway):
    """The Redis protocol without the gateway: what the gateway must reproduce."""
    client = Client(redis_server.url, shared_keys)
    yield client
    client.close()


def test_models_lists_the_live_model(sdk):
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    card = sdk.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model" and card.created > 0


def test_chat_answers_what_the_engine_generates_with_its_usage(sdk, direct):
    reply = sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    )
    rid = direct.submit(
        messages=MESSAGES, sampling={"max_tokens": 12, "ignore_eos": True, **GREEDY}
    )
    expected = direct.answer(rid)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.model == "tiny" and reply.created > 0
    [choice] = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == "length"
    usage = expected.final.usage
    assert reply.usage.prompt_tokens == usage["prompt_tokens"] > 0
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == usage["prompt_tokens"] + 12
    # The same prompt a second time: the engine served its full blocks from its cache.
    assert usage["cached_tokens"] > 0
    assert reply.usage.prompt_tokens_details.cached_tokens <= usage["cached_tokens"]


def test_chat_goes_on_with_an_assistant_answer_begun(sdk, direct):
    # vLLM's extensions, through extra_body: the prompt ends inside the assistant's turn.
    begun = [*MESSAGES, {"role": "assistant", "content": "Red, "}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    sampling = {"max_tokens": 6, "ignore_eos": True, **GREEDY}
    reply = sdk.chat.completions.create(
        model="tiny", messages=begun, max_tokens=6, extra_body={"ignore_eos": True, **options},
        **GREEDY,
    )  # fmt: skip
    expected = direct.answer(direct.submit(messages=begun, sampling=sampling, **options))
    assert reply.choices[0].message.content == expected.text
    # Not an answer after the assistant's turn closed: that prompt is longer, by the
    # end-of-turn the continued one leaves out.
    closed = direct.answer(
        direct.submit(messages=begun, sampling=sampling, add_generation_prompt=False)
    )
    assert reply.usage.prompt_tokens < closed.final.usage["prompt_tokens"]
    with pytest.raises(openai.BadRequestError, match="cannot both be true") as refused:
        sdk.chat.completions.create(
            model="tiny", messages=begun, extra_body={"continue_final_message": True}
        )
    assert refused.value.param == "continue_final_message"
    with pytest.raises(openai.BadRequestError, match="cannot set messages"):
        sdk.chat.completions.create(
            model="tiny", messages=begun, extra_body={"chat_template_kwargs": {"messages": []}}
        )


def test_every_answer_names_its_request_for_support(sdk):
    raw = sdk.chat.completions.with_raw_response.create(
        model="tiny", messages=MESSAGES, max_tokens=2, **GREEDY
    )
    reply = raw.parse()
    # The SDK's _request_id is the x-request-id header: the work's id, as in the engines.
    assert reply._request_id and reply.id == f"chatcmpl-{reply._request_id}"
    with pytest.raises(openai.NotFoundError) as refused:
        sdk.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)
    assert refused.value.request_id and refused.value.request_id.startswith("req_")


def test_top_p_0_keeps_only_the_likeliest_token(sdk):
    # OpenAI takes 0 ("temperature=0, top_p=0" for determinism): any temperature then
    # gives the greedy answer.
    args = dict(model="tiny", messages=MESSAGES, max_tokens=8, extra_body={"ignore_eos": True})
    greedy = sdk.chat.completions.create(**args, **GREEDY).choices[0].message.content
    hot = sdk.chat.completions.create(**args, temperature=2.0, top_p=0, seed=1)
    assert hot.choices[0].message.content == greedy


def test_penalties_reach_the_engine(sdk, direct):
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.5}
    args = dict(model="tiny", messages=MESSAGES, max_tokens=24, extra_body={"ignore_eos": True})
    penalized = sdk.chat.completions.create(**args, **penalties, **GREEDY)
    plain = sdk.chat.completions.create(**args, **GREEDY)
    sampling = {"max_tokens": 24, "ignore_eos": True, **penalties, **GREEDY}
    expected = direct.answer(direct.submit(messages=MESSAGES, sampling=sampling))
    assert penalized.choices[0].message.content == expected.text
    assert penalized.choices[0].message.content != plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        sdk.chat.completions.create(**args, frequency_penalty=2.5)


def test_chat_logprobs_cover_every_token_streamed_or_not(sdk):
    args = dict(model="tiny", messages=MESSAGES, max_tokens=10, extra_body={"ignore_eos": True})
    reply = sdk.chat.completions.create(**args, logprobs=True, top_logprobs=3, **GREEDY)
    [choice] = reply.choices
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: each token is its position's most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    # Each token's own bytes: a character split over tokens (each reads U+FFFD) joins up.
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode(errors="replace") == choice.message.content
    streamed = [
        item
        for chunk in sdk.chat.completions.create(
            **args, logprobs=True, top_logprobs=3, stream=True, **GREEDY
        )
        if chunk.choices and chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    assert sdk.chat.completions.create(**args, **GREEDY).choices[0].logprobs is None


def test_the_token_that_ends_an_answer_and_writes_nothing_is_not_listed(sdk):
    # EOS (id 2, <|im_end|>, forced here) ends the answer; OpenAI lists only the
    # tokens of the text, though completion_tokens counts it.
    args = dict(model="tiny", max_tokens=10, logit_bias={"2": 100}, logprobs=True, **GREEDY)
    reply = sdk.chat.completions.create(messages=MESSAGES, top_logprobs=1, **args)
    [choice] = reply.choices
    assert (choice.message.content, choice.finish_reason) == ("", "stop")
    assert choice.logprobs.content == [] and reply.usage.completion_tokens == 1
    chunks = list(sdk.chat.completions.create(messages=MESSAGES, stream=True, **args))
    assert not [c for c in chunks if c.choices and c.choices[0].logprobs]
    lists = sdk.completions.create(prompt="Once", **{**args, "logprobs": 1}).choices[0].logprobs
    assert lists.tokens == [] and lists.top_logprobs == []


def test_completion_logprobs_are_parallel_lists(sdk):
    reply = sdk.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=6, logprobs=2, temperature=0.7, seed=3
    )
    lists = reply.choices[0].logprobs
    assert len(lists.tokens) == len(lists.token_logprobs) == len(lists.top_logprobs) == 6
    # The two likeliest and, where it is neither, the token chosen (as OpenAI's).
    for token, top, lp in zip(lists.tokens, lists.top_logprobs, lists.token_logprobs, strict=True):
        assert len(top) <= 3 and lp <= 0 and top[token] == pytest.approx(lp)
    # Each token's offset is where its text starts in the prompt and completion.
    start = len("Once upon a time")
    assert lists.text_offset == [start + sum(len(t) for t in lists.tokens[:i]) for i in range(6)]
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        sdk.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=6)


def test_logit_bias_reaches_the_engine(sdk, direct):
    args = dict(model="tiny", messages=MESSAGES, max_tokens=8, extra_body={"ignore_eos": True})
    forced = sdk.chat.completions.create(**args, logit_bias={"5": 100}, **GREEDY)
    plain = sdk.chat.completions.create(**args, **GREEDY)
    sampling = {"max_tokens": 8, "ignore_eos": True, "logit_bias": [[5, 100]], **GREEDY}
    expected = direct.answer(direct.submit(messages=MESSAGES, sampling=sampling))
    assert forced.choices[0].message.content == expected.text
    assert forced.choices[0].message.content != plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        sdk.chat.completions.create(**args, logit_bias={"99999999": 1})


def test_chat_stream_with_include_usage_matches_the_plain_answer(sdk):
    args = dict(model="tiny", messages=MESSAGES, max_completion_tokens=10, **GREEDY)
    plain = sdk.chat.completions.create(**args)
    chunks = list(
        sdk.chat.completions.create(
            **args,
            stream=True,
            # include_obfuscation: the SDK types it; accepted, no chunk is padded anyway.
            stream_options={"include_usage": True, "include_obfuscation": False},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and set(finishes[:-1]) == {None}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert last.usage.completion_tokens == plain.usage.completion_tokens
    # The same prompt again: its full KV blocks come from the engine's prefix cache.
    assert last.usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_a_cache_salt_keeps_a_prompts_cached_blocks_to_its_own_salt(sdk):
    words = " ".join(f"salted{i}" for i in range(40))  # several KV blocks, this test's own
    messages = [{"role": "user", "content": words}]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        reply = sdk.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, extra_body=extra, **GREEDY
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0 and cached(None) == 0, "another salt's blocks stay its own"
    assert cached("tenant-a") > 0 and cached(None) > 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached("")


def test_text_content_parts_equal_the_joined_string(sdk):
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]
    as_parts = sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=6, **GREEDY
    )
    as_text = sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Name three\ncolours."}],
        max_tokens=6,
        **GREEDY,
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


def test_completions_of_text_and_of_token_ids_stream_and_not(sdk, direct):
    text = sdk.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, **GREEDY)
    assert text.id.startswith("cmpl-") and text.object == "text_completion"
    streamed = list(
        sdk.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=8, stream=True, **GREEDY
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert streamed[-1].choices[0].finish_reason == text.choices[0].finish_reason

    ids = [5, 9, 17, 33, 2, 101, 77]
    by_ids = sdk.completions.create(
        model="tiny", prompt=ids, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY
    )
    rid = direct.submit(
        prompt_token_ids=ids, sampling={"max_tokens": 8, "ignore_eos": True, **GREEDY}
    )
    assert by_ids.choices[0].text == direct.answer(rid).text
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.usage.completion_tokens == 8


def test_a_batch_of_prompts_answers_as_its_prompts_sent_one_by_one(sdk):
    # OpenAI's and vLLM's batch: n choices for each prompt, prompt p's choice i at p * n + i.
    prompts = ["Once upon a time", "The weather today é"]
    args = dict(model="tiny", max_tokens=6, temperature=1.0, seed=7, n=2, logprobs=1,
                extra_body={"ignore_eos": True})  # fmt: skip
    batch = sdk.completions.create(prompt=prompts, **args)
    alone = [sdk.completions.create(prompt=p, **args) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    expected = [c.text for reply in alone for c in reply.choices]
    assert [c.text for c in batch.choices] == expected
    # Each prompt counted once, its choices' completions all.
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert batch.usage.completion_tokens == 4 * 6
    # text_offset counts from each choice's own prompt's start.
    firsts = [c.logprobs.text_offset[0] for c in batch.choices]
    assert firsts == [len(prompts[0])] * 2 + [len(prompts[1])] * 2

    merged = ["", "", "", ""]
    for chunk in sdk.completions.create(prompt=prompts, stream=True, **args):
        for choice in chunk.choices:
            merged[choice.index] += choice.text
    assert merged == expected

    by_ids = sdk.completions.create(prompt=[[5, 9, 17], [33, 2]], **{**args, "n": 1})
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert by_ids.usage.prompt_tokens == 5


def test_n_2_gives_two_choices_seeded_reproducibly(sdk):
    args = dict(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        seed=1234,
        n=2,
        extra_body={"ignore_eos": True},
    )
    first = sdk.chat.completions.create(**args)
    again = sdk.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] != texts[1]  # each choice has its own seed
    single = sdk.chat.completions.create(**{**args, "n": 1})
    assert single.choices[0].message.content == texts[0]
    # The prompt counted once (the choices share it), the completions of both.
    assert first.usage.completion_tokens == 16
    assert first.usage.prompt_tokens == single.usage.prompt_tokens

    chunks = list(sdk.chat.completions.create(**args, stream=True))
    merged = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            merged[choice.index] += choice.delta.content or ""
    assert [merged[0], merged[1]] == texts


def test_stop_strings_end_the_answer_before_them(sdk):
    args = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, **GREEDY)
    full = sdk.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[6:9]
    assert stop.strip(), f"pick another window of {full!r}"
    cut = full[: full.index(stop)]
    for value in (stop, [stop, "never-seen-zzz"]):
        reply = sdk.completions.create(**args, stop=value, extra_body={"ignore_eos": True})
        assert reply.choices[0].text == cut
        assert reply.choices[0].finish_reason == "stop"


def test_priority_field_and_header_are_accepted(sdk):
    high = sdk.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, extra_body={"priority": "high"}, **GREEDY
    )
    low = sdk.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=3,
        extra_headers={"X-Tandem-Priority": "low"},
        **GREEDY,
    )
    assert high.choices[0].message.content == low.choices[0].message.content


def test_a_reply_appended_to_the_conversation_is_accepted(sdk):
    # OpenAI's documented pattern: the SDK sends the reply's fields back as they came.
    first = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, **GREEDY)
    # OpenAI's own replies also carry refusal and annotations, which it accepts back.
    theirs = {"role": "assistant", "content": "Red.", "refusal": None, "annotations": []}
    again = [*MESSAGES, first.choices[0].message, theirs, {"role": "user", "content": "More."}]
    reply = sdk.chat.completions.create(model="tiny", messages=again, max_tokens=3, **GREEDY)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_more_than_four_stop_sequences_raise_naming_stop(sdk):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(model="tiny", prompt="x", max_tokens=2, stop=list("abcde"))
    assert caught.value.param == "stop"
    assert "at most 4" in caught.value.message


def test_openai_parameters_at_neutral_values_change_nothing_and_others_are_named(sdk):
    # As an application passes them through the SDK (None is sent as null).
    args = dict(model="tiny", messages=MESSAGES, max_tokens=6, **GREEDY)
    neutral = sdk.chat.completions.create(
        **args,
        service_tier="auto",
        audio=None,
        prediction=None,
        functions=[],
        function_call="none",
        modalities=["text"],
        reasoning_effort="none",
        verbosity="medium",
        prompt_cache_key="team-a",
        prompt_cache_options={"ttl": "30m"},
        prompt_cache_retention="24h",
        safety_identifier="user-123",
        moderation=None,
    )
    plain = sdk.chat.completions.create(**args)
    assert neutral.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(**args, service_tier="flex")
    assert (caught.value.param, caught.value.code) == ("service_tier", "unsupported")
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(**args, moderation={"model": "omni-moderation-latest"})
    assert (caught.value.param, caught.value.code) == ("moderation", "unsupported")
    breakpoint_part = {"type": "text", "text": "Hi", "prompt_cache_breakpoint": {"ttl": "5m"}}
    marked = sdk.chat.completions.create(
        **{**args, "messages": [{"role": "user", "content": [breakpoint_part]}]}
    )
    unmarked = sdk.chat.completions.create(
        **{**args, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    )
    assert marked.choices[0].message.content == unmarked.choices[0].message.content


def test_every_parameter_the_sdk_sends_is_declared():
    # A parameter the installed SDK sends and the schema lacks is refused as
    # unrecognized: this names it when the SDK is upgraded (served, ignored, or refused
    # as unsupported, by name: a choice to make).
    from openai.types import completion_create_params as completion
    from openai.types.chat import chat_completion_content_part_text_param as text_part
    from openai.types.chat import completion_create_params as chat

    from tandem.gateway.schemas import ChatCompletionRequest, CompletionRequest, ContentPart

    for sdk_params, ours in (
        (chat.CompletionCreateParamsBase, ChatCompletionRequest),
        (completion.CompletionCreateParamsBase, CompletionRequest),
        (text_part.ChatCompletionContentPartTextParam, ContentPart),
    ):
        assert set(sdk_params.__annotations__) - set(ours.model_fields) == set(), ours
