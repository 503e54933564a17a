"""The gateway/engine contract: round trips, versions, and clear refusals."""

import json

import pytest

from tandem.keys import Keys
from tandem.protocol import (
    PROTOCOL_VERSION,
    ErrorCode,
    EventKind,
    Handoff,
    ProtocolError,
    ResponseEvent,
    Usage,
    WorkItem,
    as_text,
)
from tandem.registry_entry import EngineInfo, engine_entry, read_engine_entry


def test_work_item_round_trips_through_stream_fields():
    item = WorkItem(
        "r1",
        "smollm2",
        messages=[{"role": "user", "content": "hi"}],
        sampling={"max_tokens": 5},
        priority=2,
        deadline=123.0,
    )
    fields = item.to_fields()
    assert fields["v"] == str(PROTOCOL_VERSION)
    # Redis hands fields back as bytes.
    again = WorkItem.from_fields({k.encode(): v.encode() for k, v in fields.items()})
    assert again == item


def test_a_work_item_needs_exactly_one_prompt_form():
    with pytest.raises(ProtocolError, match="exactly one of prompt, messages, prompt_token_ids"):
        WorkItem("r1", "m", prompt="a", prompt_token_ids=[1])
    with pytest.raises(ProtocolError, match="0 given"):
        WorkItem("r1", "m")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("deadline", "soon", "deadline must be a number or null, got 'soon'"),
        ("priority", True, "priority must be an integer, got True"),
        ("sampling", [1], "sampling must be an object"),
        ("max_tokens_given", 1, "max_tokens_given must be true or false"),
        ("model", None, "model must be a string, got None"),
    ],
)
def test_a_work_item_field_of_the_wrong_type_is_a_protocol_error(field, value, message):
    body = {"request_id": "r1", "model": "m", "prompt": "x", field: value}
    with pytest.raises(ProtocolError, match=f"work item 'r1': {message}"):
        WorkItem.from_fields({"v": str(PROTOCOL_VERSION), "kind": "work", "data": json.dumps(body)})
    # A number where a float is expected, and null where it may be, are fine.
    assert WorkItem("r1", "m", prompt="x", created_at=5, deadline=None).created_at == 5


def test_another_protocol_version_is_refused_with_advice():
    fields = WorkItem("r1", "m", prompt="x").to_fields()
    fields["v"] = str(PROTOCOL_VERSION + 1)
    with pytest.raises(ProtocolError, match="upgrade gateway and engines together"):
        WorkItem.from_fields(fields)


def test_unknown_fields_from_a_newer_revision_are_ignored_and_missing_ones_refused():
    fields = WorkItem("r1", "m", prompt="x").to_fields()
    body = json.loads(fields["data"])
    body["future_field"] = 1
    fields["data"] = json.dumps(body)
    assert WorkItem.from_fields(fields).request_id == "r1"
    del body["request_id"]
    fields["data"] = json.dumps(body)
    with pytest.raises(ProtocolError, match="lacks request_id"):
        WorkItem.from_fields(fields)


def test_a_message_of_another_kind_is_refused():
    fields = ResponseEvent.tokens(0, [1], "a", "e1").to_fields()
    with pytest.raises(ProtocolError, match="expected a 'work' message, got 'event'"):
        WorkItem.from_fields(fields)


def test_garbage_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="unreadable"):
        WorkItem.from_fields({"v": "1", "kind": "work", "data": "{not json"})


def test_handoff_carries_its_work_item():
    item = WorkItem("r1", "m", prompt="x")
    handoff = Handoff(
        work=item.__dict__ | {},
        prompt_token_ids=[1, 2],
        first_token_ids=[3],
        kv_address="10.0.0.1:8200",
        kv_handle="r1",
        num_kv_tokens=2,
        fingerprint="abc",
        prompt_engine="p1",
        expires_at=1.0,
    )
    again = Handoff.from_fields(handoff.to_fields())
    assert again.work_item == item


def test_response_events():
    finish = ResponseEvent.finish(7, "stop", Usage(3, 7, 1), "e1")
    assert finish.is_final and finish.usage == {
        "prompt_tokens": 3,
        "completion_tokens": 7,
        "cached_tokens": 1,
    }
    error = ResponseEvent.error(ErrorCode.PROMPT_TOO_LONG, "too long", "e1")
    assert ResponseEvent.from_fields(error.to_fields()).error_code == "prompt_too_long"
    assert not ResponseEvent.tokens(0, [1], "a", "e1").is_final
    assert ResponseEvent.tokens(0, [1], "a", "e1").event == EventKind.TOKENS


def test_keys_share_a_hash_tag_per_model_and_reject_unknown_priorities():
    keys = Keys("t")
    assert keys.work_streams("llama") == [
        "t:{llama}:work:p2",
        "t:{llama}:work:p1",
        "t:{llama}:work:p0",
    ]
    assert keys.handoff_stream("llama") == "t:{llama}:handoff"
    with pytest.raises(ValueError, match="priority must be one of"):
        keys.work_stream("llama", 7)


def test_as_text_reads_replies_with_or_without_decode_responses():
    assert as_text(b"1-0") == as_text("1-0") == "1-0"
    assert as_text(7) == "7"


def test_a_registry_entry_round_trips_and_an_unreadable_one_is_skipped():
    info = EngineInfo("e1", "tiny", "normal", "127.0.0.1:8100", running=2)
    assert read_engine_entry("e1", engine_entry(info)) == info
    assert read_engine_entry("e1", engine_entry(info).encode()) == info
    for raw in ("not json", "[1]", json.dumps({"v": "99", "kind": "engine", "data": "{}"})):
        assert read_engine_entry("e1", raw) is None
