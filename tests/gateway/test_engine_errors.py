"""An engine's error event as the gateway answers it: `param` is the parameter the
engine names, else the prompt's field, also for events of engines from before
ResponseEvent.error_param."""

from __future__ import annotations

import json

from tandem.gateway.errors import from_engine
from tandem.protocol import ErrorCode, ResponseEvent


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
