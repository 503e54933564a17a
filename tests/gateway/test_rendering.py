"""Answers and chunks match the documented (OpenAI) models, field for field."""

from __future__ import annotations

import json

from tandem.gateway.errors import error_body
from tandem.gateway.rendering import ChatRenderer, ChoiceResult, CompletionRenderer
from tandem.gateway.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
)
from tandem.gateway.streaming import DONE, sse
from tandem.gateway.validation_errors import validation_error


def _choices() -> list[ChoiceResult]:
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "cached_tokens": 4}
    return [
        ChoiceResult(["Hel", "lo"], "stop", usage),
        ChoiceResult(["Bye"], "length", {**usage, "completion_tokens": 5, "cached_tokens": 7}),
    ]


def _same(model, body: dict) -> None:
    """The body validates and nothing is lost or added on the way."""
    assert model.model_validate(body).model_dump(mode="json", exclude_unset=True) == body


def test_chat_answers_and_chunks_follow_the_models():
    renderer = ChatRenderer("abc", 1700000000, "tiny", include_usage=True)
    body = renderer.response(_choices())
    _same(ChatCompletion, body)
    assert body["id"] == "chatcmpl-abc" and list(body) == [
        "id", "object", "created", "model", "choices", "usage"
    ]  # fmt: skip
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello", "Bye"]
    # The prompt once, every choice's completion tokens.
    assert body["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 8,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    for chunk in [*renderer.opening(2), renderer.text(1, "x"), renderer.finish(0, "stop")]:
        _same(ChatCompletionChunk, chunk)
        assert chunk["usage"] is None  # include_usage: null on every chunk but the last
    last = renderer.usage(_choices())
    _same(ChatCompletionChunk, last)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 15


def test_completion_answers_and_chunks_follow_the_models():
    renderer = CompletionRenderer("xyz", 1700000000, "tiny", include_usage=False)
    body = renderer.response(_choices())
    _same(Completion, body)
    assert body["id"] == "cmpl-xyz" and body["object"] == "text_completion"
    assert [c["text"] for c in body["choices"]] == ["Hello", "Bye"]
    assert renderer.opening(2) == []
    chunk = renderer.text(0, "a")
    assert "usage" not in chunk
    _same(Completion, {**chunk, "usage": None})


def _entry(token: str, logprob: float) -> dict:
    top = [{"token": token, "logprob": logprob, "bytes": list(token.encode())}]
    return {**top[0], "top_logprobs": [*top, {"token": "?", "logprob": -9.0, "bytes": [63]}]}


def test_logprobs_follow_each_endpoints_model():
    entries = [_entry("Hel", -0.5), _entry("lo", -0.25)]
    choices = [ChoiceResult(["Hel", "lo"], "stop", None, entries)]
    chat = ChatRenderer("abc", 1, "tiny", include_usage=False, logprobs=True)
    body = chat.response(choices)
    _same(ChatCompletion, body)
    assert body["choices"][0]["logprobs"] == {"content": entries, "refusal": None}
    _same(ChatCompletionChunk, chat.text(0, "Hel", entries[:1]))
    plain = ChatRenderer("abc", 1, "tiny", include_usage=False).response(choices)
    assert plain["choices"][0]["logprobs"] is None  # not asked for
    completion = CompletionRenderer("xyz", 1, "tiny", include_usage=False, logprobs=True)
    body = completion.response(choices)
    _same(Completion, body)
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hel": -0.5, "?": -9.0}, {"lo": -0.25, "?": -9.0}],
        "text_offset": [0, 3],
    }
    # Streamed, each chunk's offsets go on from the text streamed before it.
    first, second = completion.text(0, "Hel", entries[:1]), completion.text(0, "lo", entries[1:])
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert second["choices"][0]["logprobs"]["text_offset"] == [3]


def test_completion_offsets_count_from_the_prompts_start():
    # OpenAI's text_offset: where each token starts in prompt + completion, echo or not.
    entries = [_entry("Hel", -0.5), _entry("lo", -0.25)]
    choices = [ChoiceResult(["Hel", "lo"], "stop", None, entries)]
    args = ("xyz", 1, "tiny")
    completion = CompletionRenderer(*args, include_usage=False, logprobs=True, prompt_chars=(5,))
    assert completion.response(choices)["choices"][0]["logprobs"]["text_offset"] == [5, 8]
    first, second = completion.text(0, "Hel", entries[:1]), completion.text(0, "lo", entries[1:])
    assert first["choices"][0]["logprobs"]["text_offset"] == [5]
    assert second["choices"][0]["logprobs"]["text_offset"] == [8]


def test_completion_offsets_count_characters_not_the_tokens_own_decodes():
    # An emoji in two tokens: each decodes alone to U+FFFD, and counting those the
    # offsets ran past the text's end (24 tokens of 8 emoji: offsets up to 40 of 25).
    party = "\N{PARTY POPPER}".encode()  # 4 bytes
    entries = [
        {**_entry("\ufffd", -0.1), "bytes": list(party[:2])},
        {**_entry("\ufffd", -0.2), "bytes": list(party[2:])},
        {**_entry("!", -0.3), "bytes": list(b"!")},
    ]
    choices = [ChoiceResult(["\N{PARTY POPPER}!"], "stop", None, entries)]
    completion = CompletionRenderer(
        "xyz", 1, "tiny", include_usage=False, logprobs=True, prompt_chars=(5,)
    )
    offsets = completion.response(choices)["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [5, 5, 6]  # the emoji's tokens where it starts; "!" after it
    streamed = [
        completion.text(0, "", entries[:1]),
        completion.text(0, "\N{PARTY POPPER}", entries[1:2]),
        completion.text(0, "!", entries[2:]),
    ]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in streamed] == [[5], [5], [6]]


def test_completion_top_logprobs_always_hold_the_chosen_token():
    # Sampled below the top 1: OpenAI lists it too (up to logprobs + 1 keys).
    entry = {
        "token": "b",
        "logprob": -3.0,
        "bytes": [98],
        "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}],
    }
    completion = CompletionRenderer("xyz", 1, "tiny", include_usage=False, logprobs=True)
    body = completion.response([ChoiceResult(["b"], "length", None, [entry])])
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.1, "b": -3.0}]


def test_completion_top_logprobs_keep_the_likeliest_of_tokens_that_read_alike():
    # Parts of multi-byte characters all read U+FFFD: one key in the legacy dict,
    # which must keep the chosen (likeliest) token's logprob, not the last one's.
    alike = [
        {"token": "\ufffd", "logprob": -0.1, "bytes": [0xF0]},
        {"token": "a", "logprob": -2.0, "bytes": [97]},
        {"token": "\ufffd", "logprob": -6.5, "bytes": [0xE6]},
    ]
    entry = {**alike[0], "top_logprobs": alike}
    completion = CompletionRenderer("xyz", 1, "tiny", include_usage=False, logprobs=True)
    body = completion.response([ChoiceResult(["\ufffd"], "length", None, [entry])])
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"\ufffd": -0.1, "a": -2.0}]


def test_sse_frames_are_data_lines():
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_error_bodies_follow_the_model():
    _same(ErrorResponse, error_body("bad", "invalid_request_error", "n", "x"))
    error = validation_error(
        [{"type": "missing", "loc": ("body", "messages", 0, "role"), "msg": "Field required"}]
    )
    assert error.status == 400 and error.param == "messages[0].role"
    _same(ErrorResponse, json.loads(error.response().body))


def test_union_errors_name_the_deepest_location():
    errors = [
        {"type": "string_type", "loc": ("body", "prompt", "str"), "msg": "not a string"},
        {"type": "greater_than_equal", "loc": ("body", "prompt", "list[int]", 1), "msg": ">= 0"},
    ]
    assert validation_error(errors).param == "prompt[1]"
