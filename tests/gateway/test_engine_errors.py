"""An engine's error event as the gateway answers it: `param` is the parameter the
engine names, else the prompt's field, also for events of engines from before
ResponseEvent.error_param."""

from __future__ import annotations

import json
import threading

import httpx

from tandem.context_window import context_exceeded
from tandem.engine.service.responses import ResponseWriter
from tandem.gateway.errors import from_engine
from tandem.protocol import ErrorCode, ResponseEvent

from .live import STAND_IN, take_queued


def _answer(event: ResponseEvent, prompt_param: str) -> dict:
    read = ResponseEvent.from_fields(event.to_fields())
    error = from_engine(read.error_code, read.error_message, prompt_param, read.error_param)
    return error.body()["error"]


def test_the_parameter_the_engine_names_is_the_param():
    event = ResponseEvent.error(
        ErrorCode.INVALID_REQUEST, "logit_bias token id 99999 is outside", "e1", param="logit_bias"
    )
    error = _answer(event, "messages")
    assert (error["param"], error["code"]) == ("logit_bias", "invalid_request")


def test_an_event_without_a_parameter_is_about_the_prompt_as_before():
    event = ResponseEvent.error(ErrorCode.INVALID_REQUEST, "prompt token id 9 is outside", "e1")
    fields = event.to_fields()
    # As an engine from before error_param wrote it: the field absent, not null.
    data = json.loads(fields["data"])
    assert "error_param" not in data  # None: left out, as any field at its default
    old = ResponseEvent.from_fields({**fields, "data": json.dumps(data)})
    assert old.error_param is None
    error = from_engine(old.error_code, old.error_message, "prompt", old.error_param)
    assert error.param == "prompt" and error.status == 400
    assert _answer(event, "messages")["param"] == "messages"
    # Not about the request at all: no param, whatever the prompt's field.
    assert (
        _answer(ResponseEvent.error(ErrorCode.ENGINE_ERROR, "boom", "e1"), "prompt")["param"]
        is None
    )


def test_a_context_refusal_names_the_field_the_chat_request_gave(stand_in_gateway, keys):
    # The engine checks a chat prompt's room (the gateway cannot count its tokens) and
    # does not know which field max_tokens came in: it said "reduce ... max_tokens" to a
    # request that gave max_completion_tokens.
    live, conn = stand_in_gateway
    why = context_exceeded(250, 50, 256)
    answers: list[httpx.Response] = []
    chat = {"model": STAND_IN, "messages": [{"role": "user", "content": "Hi"}]}
    for field in ("max_completion_tokens", "max_tokens"):
        asking = threading.Thread(
            target=lambda body={**chat, field: 50}: answers.append(
                live.http().post("/v1/chat/completions", json=body)
            )
        )
        asking.start()
        rid = take_queued(conn, keys)
        writer = ResponseWriter(conn, keys, "stand-in-engine")
        writer.add(rid, ResponseEvent.error(ErrorCode.CONTEXT_LENGTH_EXCEEDED, why, "e"))
        writer.flush()
        asking.join(30)
    for answer, field in zip(answers, ("max_completion_tokens", "max_tokens"), strict=True):
        error = answer.json()["error"]
        assert (answer.status_code, error["code"], error["param"]) == (
            400,
            "context_length_exceeded",
            "messages",
        )
        assert error["message"].endswith(f"Please reduce the length of the prompt or of {field}.")
