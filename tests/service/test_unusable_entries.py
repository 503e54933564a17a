"""What an engine cannot use is answered, and the engine serves on: a work entry of the
wrong shape, a request whose response stream it cannot read. Real engine processes on
the test's Redis."""

from __future__ import annotations

import json

from support.polling import eventually

from tandem.protocol import PRIORITY_NORMAL, PROTOCOL_VERSION, ErrorCode, as_text

GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 9, 17, 33, 2, 101, 77, 4, 8, 15, 16, 23, 42]


def test_entries_with_a_field_of_the_wrong_type_are_answered_and_the_engine_serves_on(
    engines, client, keys
):
    # Valid JSON of another shape (a hand-made entry, another producer): each of these
    # crashed the engine, then every engine that took the entry over after it.
    engine = engines("normal")
    stream = keys.work_stream("tiny", PRIORITY_NORMAL)
    wrong = {"deadline": "soon", "created_at": "yesterday", "cache_salt": 7}
    for field, value in wrong.items():
        body = {"request_id": f"bad-{field}", "model": "tiny", "prompt_token_ids": PROMPT}
        data = json.dumps({**body, field: value})
        client.redis.xadd(stream, {"v": str(PROTOCOL_VERSION), "kind": "work", "data": data})
    for field in wrong:
        final = client.answer(f"bad-{field}", timeout=30).final
        assert final.error_code == ErrorCode.INVALID_REQUEST
        assert f"{field} must be a " in final.error_message
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 4, **GREEDY})
    assert len(client.answer(rid).token_ids) == 4
    assert engine.process.poll() is None, engine.log()


def test_a_request_whose_response_stream_is_unreadable_fails_naming_it(engines, client, keys):
    # Resuming from a history it cannot read could repeat or drop text: the engine
    # exited, naming neither the request nor the stream.
    engine = engines("normal")
    rid = "garbled"
    stream = keys.response_stream(rid)
    client.redis.xadd(stream, {"v": str(PROTOCOL_VERSION), "kind": "event", "data": "{not json"})
    client.submit(request_id=rid, prompt_token_ids=PROMPT)

    def last_event() -> dict:
        [(_, fields)] = client.redis.xrevrange(stream, count=1)
        data = as_text(fields[b"data"])
        return {} if data == "{not json" else json.loads(data)

    assert eventually(lambda: last_event().get("error_code") == ErrorCode.ENGINE_ERROR, 30)
    message = last_event()["error_message"]
    assert rid in message and stream in message and "unreadable event" in message
    other = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 4, **GREEDY})
    assert len(client.answer(other).token_ids) == 4
    assert engine.process.poll() is None, engine.log()
