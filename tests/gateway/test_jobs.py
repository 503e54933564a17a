"""Requests into work items: parameters, seeds, priorities, deadlines, estimates."""

from __future__ import annotations

import time

import pytest

from tandem.gateway.auth import ANONYMOUS, ApiKey
from tandem.gateway.context_check import check_context
from tandem.gateway.errors import GatewayError
from tandem.gateway.jobs import JobBuilder
from tandem.gateway.sampling import derive_seed
from tandem.gateway.schemas import ChatCompletionRequest, CompletionRequest
from tandem.gateway.settings import GatewaySettings
from tandem.protocol import PRIORITY_HIGH, PRIORITY_LOW, PRIORITY_NORMAL

BUILDER = JobBuilder(GatewaySettings(request_timeout=60, default_max_tokens=100, max_n=4))


def _chat(headers=None, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}], **fields}
    return BUILDER.chat(ChatCompletionRequest.model_validate(body), headers or {}, ANONYMOUS)


def test_a_chat_request_becomes_one_work_item_with_its_sampling():
    job = _chat(
        max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=7, stop="x",
        presence_penalty=-0.5, frequency_penalty=1.25,
    )  # fmt: skip
    [item] = job.items
    assert item.messages == [{"role": "user", "content": "abcdefgh"}]
    assert item.sampling == {
        "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 7, "stop": ["x"],
        "presence_penalty": -0.5, "frequency_penalty": 1.25,
    }  # fmt: skip
    assert item.priority == PRIORITY_NORMAL and item.request_id == job.base_id
    assert item.estimated_prompt_tokens == 2 + 8  # 8 characters / 4, and its template
    assert item.deadline == pytest.approx(time.time() + 60, abs=1)
    assert job.cost_tokens() == 10 + 1 + 5  # the prompt, the stop string, max_tokens
    assert job.cost_tokens(12) == 10 + 1 + 5  # the client's max_tokens: as given


def test_the_default_max_tokens_is_charged_within_the_models_context():
    # Charged at the default (--default-max-tokens, 100 here) on a model whose context
    # leaves less, which could never use it: a key whose tpm was below the default was
    # refused every request without max_tokens.
    job = _chat()
    assert not job.max_tokens_given and job.max_tokens == 100
    assert job.cost_tokens() == 10 + 100  # the context not known
    assert job.cost_tokens(64) == 64  # the prompt's 10 and the 54 left of the context
    assert job.cost_tokens(4096) == 10 + 100
    assert job.cost_tokens(5) == 10 + 1  # a prompt past the context: refused elsewhere


def test_each_chat_message_costs_its_template_tokens_too():
    # 200 empty messages were estimated at 1 token and ran ~1,400: a client leaving after
    # the first token kept the estimate's charge, its tpm quota exceeded hundreds of times.
    empty = [{"role": "user", "content": ""}] * 200
    [item] = _chat(messages=empty, max_tokens=1).items
    assert item.estimated_prompt_tokens >= 1400


def test_template_variables_are_charged_as_prompt_too():
    # The template writes them into the prompt (tools, documents): 67 KB of them were
    # charged 10 tokens of a key's tpm, and a request past its whole tpm was admitted.
    documents = [{"title": f"d{i}", "text": "lorem ipsum dolor sit amet " * 40} for i in range(30)]
    job = _chat(max_tokens=1, chat_template_kwargs={"documents": documents})
    [item] = job.items
    assert item.estimated_prompt_tokens >= len(str(documents)) // 4
    assert job.cost_tokens() == item.estimated_prompt_tokens + 1


def test_tools_with_tool_choice_none_reach_the_template_as_vllm_serves_them():
    # Refused (a 400) however the client asked: agent frameworks attach their tools to
    # every call, some with tool_choice "none" for a plain answer.
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    [item] = _chat(max_tokens=1, tools=tools, tool_choice="none").items
    assert item.chat_template_kwargs == {"tools": tools}
    assert item.estimated_prompt_tokens > _chat(max_tokens=1).items[0].estimated_prompt_tokens
    own = [{"type": "function", "function": {"name": "other"}}]
    [item] = _chat(tools=tools, tool_choice="none", chat_template_kwargs={"tools": own}).items
    assert item.chat_template_kwargs == {"tools": own}  # the kwargs' own win, as vLLM's
    for choice in (None, "auto", "required"):  # a tool call asked for, or likely
        with pytest.raises(GatewayError, match=r"tool_choice|tools"):
            _chat(tools=tools, tool_choice=choice)


def test_stop_strings_are_charged_as_what_each_choice_carries():
    # 4 stop strings of 255 kB with n=16 held 16 MB of Redis for 46 tokens of a tpm.
    stops = ["x" * 4000] * 4
    plain = _chat(max_tokens=1, n=2)
    stopped = _chat(max_tokens=1, n=2, stop=stops)
    assert stopped.cost_tokens() - plain.cost_tokens() == 2 * 4000
    # Not the prompt's: the queued-tokens gauge the autoscaler reads counts prompts.
    assert stopped.items[0].estimated_prompt_tokens == plain.items[0].estimated_prompt_tokens


def test_a_template_of_the_clients_own_is_refused():
    # chat_template_kwargs reached the engines' encode_chat: its chat_template replaced
    # the model's, a client's Jinja run on the engine (range loops held it for hours).
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(GatewayError, match="cannot set chat_template") as refused:
        _chat(chat_template_kwargs={"chat_template": loops})
    assert refused.value.param == "chat_template_kwargs"


def test_top_p_0_is_the_likeliest_token_alone():
    [item] = _chat(temperature=1.0, top_p=0, top_k=5).items
    assert item.sampling["top_k"] == 1 and "top_p" not in item.sampling


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_0_or_minus_1_is_vllms_every_token(top_k):
    # Clients written for vLLM send them explicitly: they were refused (a 400).
    [item] = _chat(top_k=top_k).items
    assert "top_k" not in item.sampling


def test_developer_messages_are_system_messages():
    # OpenAI's newer name for the system role; chat templates know only "system".
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": t} for t in ("Hi", "!")]},
    ]
    [item] = _chat(messages=messages).items
    assert item.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\n!"},
    ]


def test_a_name_goes_to_the_engine_and_one_quoting_control_tokens_is_refused():
    # It was dropped: a template that renders names got another prompt than vLLM's.
    messages = [{"role": "user", "name": "alice_1", "content": "Hi"}]
    [item] = _chat(messages=messages).items
    assert item.messages == [{"role": "user", "name": "alice_1", "content": "Hi"}]
    for name in ("<|im_start|>system", "two words", ""):
        with pytest.raises(GatewayError) as refused:
            _chat(messages=[{"role": "user", "name": name, "content": "Hi"}])
        assert refused.value.param == "messages[0].name", name
        assert "must match the pattern '^[^\\s<|\\\\/>]+$'" in refused.value.message


def test_n_choices_get_distinct_reproducible_seeds_the_first_keeps_its_own():
    job = _chat(n=3, seed=42, max_tokens=4)
    seeds = [item.sampling["seed"] for item in job.items]
    assert seeds[0] == 42 and len(set(seeds)) == 3
    assert seeds == [derive_seed(42, i) for i in range(3)]
    assert [item.request_id for item in job.items] == [f"{job.base_id}-{i}" for i in range(3)]
    assert job.cost_tokens() == 3 * (10 + 4)
    unseeded = _chat(n=2)
    assert all("seed" not in item.sampling for item in unseeded.items)


def test_defaults_of_max_tokens():
    assert _chat().max_tokens == 100  # the server's default for chat
    body = CompletionRequest(model="m", prompt="abc")
    assert BUILDER.completion(body, {}, ANONYMOUS).max_tokens == 16  # OpenAI's for completions
    assert _chat(max_completion_tokens=9).max_tokens == 9


def test_only_a_max_tokens_the_client_gave_must_fit_in_the_context():
    # The engine refuses a prompt that leaves less room than the client's max_tokens;
    # a default only stops generation where the context ends.
    assert [i.max_tokens_given for i in _chat(n=2, max_tokens=5).items] == [True, True]
    assert _chat(max_completion_tokens=5).items[0].max_tokens_given
    assert not _chat().items[0].max_tokens_given
    given = CompletionRequest(model="m", prompt="abc", max_tokens=16)
    assert BUILDER.completion(given, {}, ANONYMOUS).items[0].max_tokens_given
    default = CompletionRequest(model="m", prompt="abc")
    assert not BUILDER.completion(default, {}, ANONYMOUS).items[0].max_tokens_given


def test_priority_from_the_field_or_the_header():
    assert _chat().items[0].priority == PRIORITY_NORMAL
    assert _chat({"x-tandem-priority": "HIGH"}).items[0].priority == PRIORITY_HIGH
    assert _chat({"x-tandem-priority": "high"}, priority="low").items[0].priority == PRIORITY_LOW
    with pytest.raises(GatewayError) as caught:  # the field wins, but a typo is still refused
        _chat({"x-tandem-priority": "urgent"}, priority="low")
    assert caught.value.param == "X-Tandem-Priority"


def test_a_key_asks_for_no_priority_above_its_max_priority():
    # Any key could ask for high, and engines take high first: one tenant jumped the queue.
    team = ApiKey("team", max_priority="normal")
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": "high"}
    )
    with pytest.raises(GatewayError) as caught:
        BUILDER.chat(body, {}, team)
    refused = caught.value
    assert (refused.status, refused.code, refused.param) == (
        403,
        "priority_not_allowed",
        "priority",
    )
    assert "'team' may ask for priority normal at most" in refused.message
    with pytest.raises(GatewayError):
        BUILDER.chat(
            body.model_copy(update={"priority": None}), {"x-tandem-priority": "high"}, team
        )
    for allowed in ("normal", "low"):
        item = BUILDER.chat(body.model_copy(update={"priority": allowed}), {}, team).items[0]
        assert item.priority == (PRIORITY_NORMAL if allowed == "normal" else PRIORITY_LOW)
    # Asking for none is no ask: normal, or the key's limit below it (every request of a
    # max_priority: low key was refused, SDKs sending no priority).
    unasked = body.model_copy(update={"priority": None})
    assert BUILDER.chat(unasked, {}, team).items[0].priority == PRIORITY_NORMAL
    batch = ApiKey("batch", max_priority="low")
    assert BUILDER.chat(unasked, {}, batch).items[0].priority == PRIORITY_LOW


def test_an_empty_list_of_content_parts_is_refused():
    with pytest.raises(GatewayError) as caught:
        _chat(messages=[{"role": "user", "content": []}])
    assert caught.value.param == "messages[0].content"


def test_the_timeout_header_only_lowers_the_deadline():
    assert _chat({"x-tandem-timeout": "2.5"}).timeout == 2.5
    assert _chat({"x-tandem-timeout": "9999"}).timeout == 60
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(GatewayError) as caught:
            _chat({"x-tandem-timeout": bad})
        assert caught.value.param == "X-Tandem-Timeout"


def test_prompts_text_token_ids_and_lists_of_one():
    def prompt(value):
        return BUILDER.completion(CompletionRequest(model="m", prompt=value), {}, ANONYMOUS).items[
            0
        ]

    assert prompt("hello").prompt == "hello"
    assert prompt(["hello"]).prompt == "hello"
    assert prompt([1, 2, 3]).prompt_token_ids == [1, 2, 3]
    assert prompt([[4, 5]]).prompt_token_ids == [4, 5]
    assert prompt([1, 2, 3]).estimated_prompt_tokens == 3
    # UTF-8 bytes / 4: CJK text runs about a token a character, not a quarter.
    assert prompt("漢字" * 20).estimated_prompt_tokens == 30
    assert prompt("héllo").estimated_prompt_tokens == 2


def test_a_batch_of_prompts_queues_each_prompts_choices_in_a_row():
    body = CompletionRequest(model="m", prompt=["abcdefgh", "x" * 400], n=2, max_tokens=10, seed=5)
    job = BUILDER.completion(body, {}, ANONYMOUS)
    assert job.prompts == 2 and job.choices_per_prompt == 2
    assert [item.prompt for item in job.items] == ["abcdefgh"] * 2 + ["x" * 400] * 2
    assert job.request_ids == [f"{job.base_id}-{i}" for i in range(4)]
    # Each prompt's choice i seeded as that prompt sent alone.
    seeds = [item.sampling["seed"] for item in job.items]
    assert seeds == [5, derive_seed(5, 1)] * 2
    # Each choice charged its own prompt: 2 x (2 + 10) + 2 x (100 + 10).
    assert job.cost_tokens() == 2 * 12 + 2 * 110
    # Without max_tokens, each prompt's default is cut to the room its prompt leaves.
    unset = BUILDER.completion(body.model_copy(update={"max_tokens": None}), {}, ANONYMOUS)
    assert unset.cost_tokens(104) == 2 * (2 + 16) + 2 * (100 + 4)
    assert unset.counted_max_tokens(104) == 16


def test_a_batch_too_long_for_the_context_names_its_prompt():
    body = CompletionRequest(model="m", prompt=[[1, 2], [3] * 50], max_tokens=5)
    with pytest.raises(GatewayError) as caught:
        check_context(BUILDER.completion(body, {}, ANONYMOUS), max_model_len=40)
    assert caught.value.code == "context_length_exceeded"
    assert "prompt has 50 tokens" in caught.value.message
    assert caught.value.message.endswith("(prompt 1 of the batch)")
    check_context(BUILDER.completion(body, {}, ANONYMOUS), max_model_len=64)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 5}, "n"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_refused_parameters_are_named(fields, param):
    with pytest.raises(GatewayError) as caught:
        _chat(**fields)
    assert caught.value.status == 400 and caught.value.param == param


def test_logprobs_become_the_engines_count_of_alternatives():
    assert _chat(logprobs=True, top_logprobs=3).items[0].sampling["logprobs"] == 3
    assert _chat(logprobs=True).items[0].sampling["logprobs"] == 0
    assert _chat(logprobs=True).logprobs and not _chat(logprobs=False).logprobs
    assert "logprobs" not in _chat(logprobs=False).items[0].sampling
    body = CompletionRequest(model="m", prompt="x", logprobs=2)
    assert BUILDER.completion(body, {}, ANONYMOUS).items[0].sampling["logprobs"] == 2


def test_logit_bias_keys_become_token_ids_and_bad_ones_are_named():
    [item] = _chat(logit_bias={"20": -100, "1": 2.5}).items
    assert item.sampling["logit_bias"] == [[20, -100], [1, 2.5]]
    # A key past int()'s 4,300 digits was a 500.
    for bias in ({"x": 1.0}, {"-1": 1.0}, {"1.5": 1.0}, {"1": 100.5}, {"1" * 5000: 1.0}):
        with pytest.raises(GatewayError) as caught:
            _chat(logit_bias=bias)
        assert caught.value.status == 400 and caught.value.param == "logit_bias", bias


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("function_call", "auto"),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("reasoning_effort", "low"),
        ("response_format", {"type": "json_object"}),
        ("service_tier", "flex"),
        ("tool_choice", "auto"),
        ("tools", [{"type": "function"}]),
        ("verbosity", "low"),
        ("web_search_options", {}),
    ],
)
def test_unimplemented_openai_parameters_are_refused_by_name(name, value):
    with pytest.raises(GatewayError) as caught:
        _chat(**{name: value})
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        name,
        "unsupported",
    )
    assert caught.value.message.startswith(name)


def test_a_text_format_with_an_unknown_field_names_the_field():
    # It was "response_format other than text is not supported", its type being text.
    with pytest.raises(GatewayError) as caught:
        _chat(response_format={"type": "text", "strict": True})
    assert (caught.value.status, caught.value.param) == (400, "response_format.strict")
    assert caught.value.message == (
        "Unrecognized request argument supplied: response_format.strict"
    )


def test_neutral_values_of_unsupported_parameters_pass():
    job = _chat(
        audio=None,
        logprobs=False,
        frequency_penalty=0,
        function_call="none",
        functions=[],
        presence_penalty=0.0,
        logit_bias={},
        modalities=["text"],
        prediction=None,
        # Hints that change no answer: accepted, unused.
        prompt_cache_key="team-a",
        reasoning_effort="none",
        response_format={"type": "text"},
        safety_identifier="user-123",
        service_tier="auto",
        tool_choice="none",
        verbosity="medium",
        web_search_options=None,
        n=1,
    )
    assert job.n == 1
    assert _chat(service_tier="default", function_call=None).n == 1
    body = CompletionRequest(model="m", prompt="x", best_of=2, n=2, echo=False, suffix="")
    assert BUILDER.completion(body, {}, ANONYMOUS).n == 2


def test_the_digest_ignores_how_the_answer_is_delivered():
    streamed = _chat(stream=True, stream_options={"include_usage": True})
    assert streamed.digest == _chat().digest != _chat(max_tokens=3).digest


def test_the_digest_counts_only_the_fields_sent():
    # A later version's field, default and all, leaves the digest of a request that
    # does not send it as it was: replicas of both versions read a retry alike.
    class Later(ChatCompletionRequest):
        reasoning: bool = False

    body = {"model": "m", "messages": [{"role": "user", "content": "abcdefgh"}], "top_k": None}
    now = BUILDER.chat(ChatCompletionRequest.model_validate(body), {}, ANONYMOUS).digest
    assert BUILDER.chat(Later.model_validate(body), {}, ANONYMOUS).digest == now == _chat().digest
    assert _chat(temperature=0.5).digest != now


def test_the_digest_reads_an_objects_keys_in_any_order():
    # A proxy or retry layer that re-serialises the body reorders its objects' keys: the
    # same request, and a retry must attach to it, not be refused as another (409).
    ordered = _chat(logit_bias={"5": 1.0, "7": -1.0}, chat_template_kwargs={"a": 1, "b": 2})
    reordered = _chat(logit_bias={"7": -1.0, "5": 1.0}, chat_template_kwargs={"b": 2, "a": 1})
    assert ordered.digest == reordered.digest != _chat(logit_bias={"5": 1.0}).digest


def test_chat_template_kwargs_may_set_the_template_options_and_win():
    # vLLM merges them over the named options: a client written for it sets them there.
    def item(**extra):
        return _chat(messages=[{"role": "user", "content": "hi"}], **extra).items[0]

    begun = item(chat_template_kwargs={"continue_final_message": True},
                 add_generation_prompt=False)  # fmt: skip
    assert (begun.add_generation_prompt, begun.continue_final_message) == (False, True)
    assert begun.chat_template_kwargs is None
    flipped = item(add_generation_prompt=True,
                   chat_template_kwargs={"add_generation_prompt": False, "x": 1})  # fmt: skip
    assert (flipped.add_generation_prompt, flipped.chat_template_kwargs) == (False, {"x": 1})
    refusals = {
        "cannot both be true": {"chat_template_kwargs": {"continue_final_message": True}},
        "must be true or false": {"chat_template_kwargs": {"add_generation_prompt": "no"}},
    }
    for why, extra in refusals.items():
        with pytest.raises(GatewayError, match=why) as refused:
            item(**extra)
        assert refused.value.param in ("continue_final_message", "chat_template_kwargs")

    # Nested 600 deep, the work item's encoding recursed past Python's limit: a 500
    # with a 3,000-line traceback, retried twice by the SDKs.
    def nested(depth: int) -> dict:
        value: dict = {}
        for _ in range(depth - 1):
            value = {"x": value}
        return value

    assert item(chat_template_kwargs=nested(64)).chat_template_kwargs == nested(64)
    with pytest.raises(GatewayError, match="more than 64 levels deep") as refused:
        item(chat_template_kwargs=nested(600))
    assert (refused.value.status, refused.value.param) == (400, "chat_template_kwargs")


def test_the_prefix_cache_salt_is_the_keys_own_then_the_requests():
    def salt(caller: ApiKey, **extra) -> str | None:
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
        )
        return BUILDER.chat(body, {}, caller).items[0].cache_salt

    own = ApiKey("team-a", own_prefix_cache=True)
    assert salt(ANONYMOUS) is None, "the model's shared cache by default"
    assert salt(ANONYMOUS, cache_salt="u1") == "salt=u1"
    assert salt(own) == "key=team-a"
    assert salt(own, cache_salt="u1") == "key=team-a\nsalt=u1"
    # A request's salt cannot spell a key's own: tagged apart.
    assert salt(ANONYMOUS, cache_salt="key=team-a") != salt(own)
    with pytest.raises(ValueError, match="cache_salt"):
        salt(ANONYMOUS, cache_salt="")
