"""Engine processes serving from a real Redis: results, handoff, crashes, drain.

Every engine here is a real `tandem engine` process on a tiny seeded random
model; requests go in through the protocol module exactly as the gateway
sends them.
"""

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
import redis
from support.engines import EngineProcess
from support.polling import eventually

from tandem import process_tree
from tandem.engine import LLM, SamplingParams
from tandem.engine.model.model_config import RANDOM_SHAPES
from tandem.engine.service.registry import Registry
from tandem.protocol import (
    HANDOFF_GROUP,
    PRIORITY_NORMAL,
    PROTOCOL_VERSION,
    WORK_GROUP,
    ErrorCode,
    EventKind,
    Handoff,
    ResponseEvent,
    WorkItem,
    as_text,
)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference():
    """The offline engine on the same seeded weights: what every service path must match."""
    llm = LLM("random:tiny", max_model_len=2048, num_kv_blocks=160)

    def greedy(prompt_token_ids, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, **GREEDY)
        return llm.generate(prompt_token_ids=[prompt_token_ids], sampling_params=params)[0]

    return greedy


PROMPT = [5, 9, 17, 33, 2, 101, 77, 4, 8, 15, 16, 23, 42]
# Room for 2,000 tokens: seconds of decoding on a 2-core CPU, where a test must
# act on a request still running (a few hundred took a fast machine ~0.1 s).
LONG = ("--max-model-len", "2048", "--num-kv-blocks", "160")


def group_consumers(client) -> set[str]:
    stream = client.keys.work_stream("tiny", 1)
    return {as_text(c["name"]) for c in client.redis.xinfo_consumers(stream, "engines")}


def test_normal_engine_streams_what_the_offline_engine_generates(engines, client, reference):
    engine = engines("normal")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 24, **GREEDY})
    answer = client.answer(rid)
    expected = reference(PROMPT, 24)
    assert answer.ok and answer.final.finish_reason == "length"
    assert answer.token_ids == expected.token_ids
    assert answer.text == expected.text
    assert answer.final.usage == {"prompt_tokens": 13, "completion_tokens": 24, "cached_tokens": 0}
    # Tokens per second and billing from /metrics: the usage, counted once.
    assert engine.metric("tandem_engine_generation_tokens_total") == 24
    assert engine.metric("tandem_engine_prompt_tokens_total") == 13
    # Its context length is in its registry entry: the gateway refuses by it up front.
    [entry] = Registry(client.redis, client.keys).live()
    assert (entry.engine_id, entry.max_model_len) == (engine.engine_id, 256)


def test_prompt_and_completion_engines_match_normal_and_really_move_kv(engines, client, reference):
    prompt = engines("prompt")
    decode = engines("completion")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 24, **GREEDY})
    answer = client.answer(rid)
    assert answer.ok
    assert answer.token_ids == reference(PROMPT, 24).token_ids
    assert answer.engines == {prompt.engine_id, decode.engine_id}
    assert decode.metric("tandem_engine_kv_transfer_bytes_total") > 0
    # What the decoder received is what the prompt engine counts as served.
    assert prompt.metric("tandem_engine_kv_served_bytes_total") == decode.metric(
        "tandem_engine_kv_transfer_bytes_total"
    )
    assert decode.metric("tandem_engine_kv_transfer_failures_total") == 0
    # Its usage is counted where the request finished, once.
    assert decode.metric("tandem_engine_generation_tokens_total") == 24
    assert prompt.metric("tandem_engine_generation_tokens_total") == 0
    # The decoder never prefilled: every token it computed was a decode token.
    assert decode.metric("tandem_engine_scheduled_tokens_total", kind="prefill") == 0
    # Freed after the fetch, and the gauges say so within a loop, not at the next
    # heartbeat (2 s): an idle prompt engine steps no more.
    assert eventually(lambda: prompt.metric("tandem_engine_kv_pinned_requests") == 0, 1.0)
    assert prompt.metric("tandem_engine_kv_cache_usage") == 0


def test_bad_requests_end_with_clear_errors(engines, client):
    engines("normal")
    too_long = client.submit(prompt_token_ids=[1] * 300)
    bad_params = client.submit(prompt_token_ids=[1, 2], sampling={"max_tokens": 0})
    unknown_param = client.submit(prompt_token_ids=[1, 2], sampling={"max_tokns": 5})
    out_of_vocab = client.submit(prompt_token_ids=[1, 99999])
    bias_out_of_vocab = client.submit(
        prompt_token_ids=[1, 2], sampling={"max_tokens": 4, "logit_bias": [[99999, 5.0]]}
    )
    a, b, c, d, e = (
        client.answer(r).final
        for r in (too_long, bad_params, unknown_param, out_of_vocab, bias_out_of_vocab)
    )
    assert a.error_code == ErrorCode.PROMPT_TOO_LONG
    assert "has 300 tokens, more than the 255 that leave room" in a.error_message
    assert (
        b.error_code == ErrorCode.INVALID_REQUEST
        and "max_tokens must be at least 1" in b.error_message
    )
    assert c.error_code == ErrorCode.INVALID_REQUEST and "max_tokns" in c.error_message
    assert d.error_code == ErrorCode.INVALID_REQUEST and "outside the vocabulary" in d.error_message
    # The refused parameter is named (the gateway's error param); the prompt is the default.
    assert d.error_param is None
    assert (
        e.error_code == ErrorCode.INVALID_REQUEST and "logit_bias token id 99999" in e.error_message
    )
    assert e.error_param == "logit_bias"


def _readyz(engine) -> str:
    try:
        with urllib.request.urlopen(engine.url("/readyz"), timeout=1) as answer:
            return answer.read().decode()
    except urllib.error.HTTPError as refused:  # 503 while starting or draining
        return refused.read().decode()
    except OSError:
        return ""


def _pending(redis_url, stream, group):
    client = redis.Redis.from_url(redis_url)
    try:
        return client.xpending(stream, group)["pending"]
    finally:
        client.close()


def test_kill_9_of_a_decoder_mid_decode_loses_nothing(engines, client, reference, redis_url, keys):
    engines("prompt", *LONG)
    claim = ("--claim-idle-ms", "1500", *LONG)
    first = engines("completion", *claim)
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 2000, **GREEDY})
    seen = 0
    for event in client.events(rid, timeout=60):
        if event.engine_id == first.engine_id and event.event == EventKind.TOKENS:
            seen += len(event.token_ids)
            if seen >= 10:
                break
    first.kill()  # mid-decode: its handoff entry stays pending
    second = engines("completion", *claim)
    answer = client.answer(rid, timeout=60)  # taken over (claim idle 1.5 s), never hung
    assert answer.ok, answer.final
    assert answer.token_ids == reference(PROMPT, 2000).token_ids  # resumed, no token twice
    assert second.engine_id in answer.engines
    assert _pending(redis_url, keys.handoff_stream("tiny"), HANDOFF_GROUP) == 0


def test_kill_9_of_the_prompt_engine_before_the_fetch_recomputes(
    engines, client, reference, redis_url, keys
):
    prompt = engines("prompt")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 20, **GREEDY})
    conn = redis.Redis.from_url(redis_url)
    # No decoder yet: the handoff waits in its stream.
    assert eventually(lambda: conn.xlen(keys.handoff_stream("tiny")) > 0, 30), "no handoff"
    conn.close()
    prompt.kill()
    decode = engines("completion")
    answer = client.answer(rid)
    assert answer.ok and answer.token_ids == reference(PROMPT, 20).token_ids
    assert decode.metric("tandem_engine_kv_transfer_failures_total", reason="unreachable") == 1


def test_handoffs_a_decoder_has_no_room_for_go_back_for_one_that_has(
    engines, client, redis_url, keys
):
    # A decoder's pool holds one of these sequences at a time. The first decoder pulls
    # the six handoffs waiting, admits one, parks one, and gives the others back at
    # once; they waited behind the first, served one by one, while a decoder started
    # for the load sat idle.
    engines("prompt", "--max-model-len", "1024", "--num-kv-blocks", "240")
    prompts = [[5 + i, *(10 + k % 400 for k in range(549))] for i in range(6)]
    for prompt in prompts:
        client.submit(prompt_token_ids=prompt, sampling={"max_tokens": 450})
    conn = redis.Redis.from_url(redis_url)
    stream = keys.handoff_stream("tiny")
    assert eventually(lambda: conn.xlen(stream) == 6, 60), "the prompts were not prefilled"
    # One sequence of 1,024 tokens; the claim timeout past the test's horizon.
    tight = ("--max-model-len", "1024", "--num-kv-blocks", "64", "--claim-idle-ms", "60000")
    first = engines("completion", *tight)

    def handed_back() -> int:  # pending, but idle as if for a day: any pull takes them
        rows = conn.xpending_range(stream, HANDOFF_GROUP, "-", "+", 10)
        return sum(row["time_since_delivered"] > 3_600_000 for row in rows)

    # Four at first; three once it finished its first and took its parked one.
    assert eventually(lambda: handed_back() >= 3, 30)
    assert eventually(lambda: first.metric("tandem_engine_handoffs_parked") == 1, 10)
    first.process.send_signal(signal.SIGSTOP)  # busy with its two for a while yet
    second = engines("completion", *tight)
    # It serves those it was given back, long before the claim timeout frees the rest.
    assert eventually(lambda: second.metric("tandem_engine_requests_total") >= 3, 20)
    conn.close()


def test_a_prompt_engine_stopped_mid_prefill_publishes_nothing_once_taken_over(
    engines, client, redis_url, keys
):
    # Stopped inside a prefill step past the claim timeout, the first prompt engine
    # came back, finished the step and published its handoff before its keep-alive
    # found the request taken: a second decoder pass over the same request (with
    # sampling, two continuations mixed in one stream).
    medium = ("--model", "random:medium", "--max-model-len", "2048", "--num-kv-blocks", "200")
    takeover = (*medium, "--claim-idle-ms", "2000", "--threads", "1")
    first = engines("prompt", *takeover)
    client.submit(
        prompt_token_ids=[5 + i % 300 for i in range(1500)],  # ~0.7 s to prefill
        sampling={"max_tokens": 8, **GREEDY},
    )
    conn = redis.Redis.from_url(redis_url)
    work, handoffs = keys.work_stream("tiny", 1), keys.handoff_stream("tiny")

    def pulled() -> bool:
        rows = conn.xpending_range(work, "engines", "-", "+", 1)
        return bool(rows) and as_text(rows[0]["consumer"]) == first.engine_id

    assert eventually(pulled, 30, interval=0.002)
    first.process.send_signal(signal.SIGSTOP)  # inside the prefill step
    assert conn.xlen(handoffs) == 0, "stopped too late: it published"
    try:
        engines("prompt", *takeover)  # takes the request over after 2 s
        assert eventually(lambda: conn.xlen(handoffs) == 1, 30)  # no decoder: it stays
    finally:
        first.process.send_signal(signal.SIGCONT)
    # Its step ends (the prefill counted), then its writes: the handoff is dropped.
    assert eventually(lambda: first.metric("tandem_engine_steps_total", kind="prefill") >= 1)
    time.sleep(1.0)
    assert conn.xlen(handoffs) == 1
    assert eventually(lambda: first.metric("tandem_engine_kv_pinned_requests") == 0, 10)
    conn.close()


def test_a_handoff_longer_than_the_decoders_context_ends_with_a_clear_error(engines, client):
    # The prompt engine serves 1,024 tokens, the decoder 256: the decoder could never
    # find room for it, and waited for it (holding every later handoff) until the
    # deadline; one that fit the prompt but not max_tokens stopped short, "length".
    engines("prompt", "--max-model-len", "1024", "--num-kv-blocks", "80")
    engines("completion", "--max-model-len", "256")
    long = client.submit(prompt_token_ids=[5] * 300, sampling={"max_tokens": 4, **GREEDY})
    answer = client.answer(long, timeout=30)
    assert answer.final.error_code == "prompt_too_long"
    assert "maximum context length is 256 tokens" in answer.final.error_message
    wide = client.submit(
        prompt_token_ids=PROMPT, sampling={"max_tokens": 400, **GREEDY}, max_tokens_given=True
    )
    answer = client.answer(wide, timeout=30)
    assert answer.final.error_code == "context_length_exceeded"
    fits = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 8, **GREEDY})
    assert client.answer(fits, timeout=30).ok  # the decoder serves on
    # The prompt engine's first token fills the decoder's context: it ends there.
    full = client.submit(prompt_token_ids=[5] * 255, sampling={"max_tokens": 4, **GREEDY})
    answer = client.answer(full, timeout=30)
    assert answer.ok and answer.final.finish_reason == "length"
    assert len(answer.token_ids) == 1


def forged_handoff(rid: str, first: list[int], fingerprint: str, *, max_tokens: int) -> Handoff:
    """A handoff of PROMPT from a prompt engine nobody runs (its KV unreachable)."""
    sampling = {"max_tokens": max_tokens, **GREEDY}
    return Handoff(
        work=WorkItem(rid, "tiny", prompt_token_ids=PROMPT, sampling=sampling).__dict__,
        prompt_token_ids=PROMPT,
        first_token_ids=first,
        kv_address="127.0.0.1:1",
        kv_handle=rid,
        num_kv_tokens=len(PROMPT),
        fingerprint=fingerprint,
        prompt_engine="nobody",
        expires_at=time.time() + 60,
    )


def test_a_handoff_with_another_model_fingerprint_is_refused_and_recomputed(
    engines, client, reference, redis_url, keys
):
    decode = engines("completion")

    def forged(rid: str, first: list[int]) -> Handoff:
        return forged_handoff(rid, first, "another-model", max_tokens=12)

    first = reference(PROMPT, 1).token_ids
    conn = redis.Redis.from_url(redis_url)
    # The other model's vocabulary is larger: its first token is none of this one's (it
    # reached the embedding, and the step failed with every request prefilled in it).
    beyond = RANDOM_SHAPES["tiny"]["vocab_size"]
    conn.xadd(keys.handoff_stream("tiny"), forged("foreign", [beyond]).to_fields())
    conn.xadd(keys.handoff_stream("tiny"), forged("forged", first).to_fields())
    conn.close()
    answer = client.answer("forged")
    assert answer.ok
    assert first + answer.token_ids == reference(PROMPT, 12).token_ids
    foreign = client.answer("foreign")
    # Both mismatched; the foreign one cannot go on here: the engines' fault, not the
    # request's (it was an invalid_request).
    assert decode.metric("tandem_engine_kv_transfer_failures_total", reason="mismatch") == 2
    # Said in its log, naming the prompt engine (it was only a metric).
    assert "prompt engine nobody serves another model" in decode.log()
    assert foreign.final.error_code == "engine_error"
    assert foreign.final.error_message == (
        "the prompt engine nobody serves another model under this name: its token id "
        f"{beyond} is outside this model's vocabulary ({beyond})"
    )
    assert "step failed" not in decode.log()


def test_a_handoff_whose_numbers_disagree_is_refused_and_the_decoder_serves_on(
    engines, client, reference, redis_url, keys
):
    decode = engines("completion")
    conn = redis.Redis.from_url(redis_url)
    for rid, change in (("too-many", {"num_kv_tokens": 300}), ("undated", {"expires_at": "soon"})):
        fields = forged_handoff(rid, [5], "f", max_tokens=4).to_fields()
        fields["data"] = json.dumps({**json.loads(fields["data"]), **change})
        conn.xadd(keys.handoff_stream("tiny"), fields)
        answer = client.answer(rid)
        assert answer.final.error_code == "invalid_request"
        assert next(iter(change)) in answer.final.error_message
    conn.close()
    assert decode.process.poll() is None, "alive"
    assert decode.metric("tandem_engine_kv_cache_usage") == 0, "nothing reserved for them"


def test_sigterm_drains_running_requests_takes_no_new_ones_and_exits_0(engines, client, reference):
    engine = engines("normal", "--drain-timeout", "60")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 150, **GREEDY})
    for event in client.events(rid, timeout=60):
        if event.event == EventKind.TOKENS:
            break  # it is running
    engine.process.send_signal(15)
    # Draining once /readyz says so: a fixed pause assumed the signal handled by then.
    assert eventually(lambda: "draining" in _readyz(engine), 30), "never draining"
    late = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 5, **GREEDY})
    assert engine.process.wait(timeout=60) == 0
    assert client.answer(rid).token_ids == reference(PROMPT, 150).token_ids
    # Gone with nothing pending: no longer listed in the group (pods come and go).
    assert engine.engine_id not in group_consumers(client)
    # The late request is still queued for another engine.
    other = engines("normal")
    assert client.answer(late).ok and other.engine_id in client.answer(late).engines


def test_a_drain_that_times_out_hands_its_requests_back_at_once(engines, client, reference):
    first = engines("normal", "--drain-timeout", "0.5", *LONG)
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 2000, **GREEDY})
    next(e for e in client.events(rid, timeout=60) if e.event == EventKind.TOKENS)
    assert first.terminate() == 0  # with the request still running
    assert first.engine_id in group_consumers(client)  # its entry is still pending there
    # The default --claim-idle-ms is 30 s: only an entry handed back is taken sooner
    # than that (so 20 s without a token fails), and only one whose handed-back
    # delivery is not counted gets past --max-deliveries 1.
    second = engines("normal", "--max-deliveries", "1", *LONG)
    answer = client.answer(rid, timeout=20)
    assert answer.ok, answer.final
    assert answer.token_ids == reference(PROMPT, 2000).token_ids  # resumed, no token twice
    assert answer.engines == {first.engine_id, second.engine_id}


def test_a_second_engine_with_a_live_engines_id_refuses_to_start(engines):
    # Both served every request (each took the other's entries as a dead namesake's),
    # sampled answers a mix of the two.
    first = engines("normal", "--engine-id", "dup-1")
    with pytest.raises(RuntimeError, match=r"engine id 'dup-1' \(--engine-id\) is taken"):
        engines("normal", "--engine-id", "dup-1")
    first.stop()  # killed: its entry lasts its TTL, but beats no more
    assert engines("normal", "--engine-id", "dup-1").process.poll() is None  # a restart


def test_two_data_parallel_ranks_vote_through_gloo_and_serve(engines, client, reference):
    # At most two waiting requests per rank: both ranks must take work.
    group = engines("normal", "--data-parallel-size", "2", "--max-waiting", "2")
    # Ready is rank 0's /readyz: wait for rank 1 too, or its start counts as serving time.
    ids = {group.engine_id, f"{group.engine_id}-r1"}
    registry = Registry(client.redis, client.keys)
    live = lambda: {e.engine_id for e in registry.live()}  # noqa: E731
    assert eventually(lambda: ids <= live(), 120), f"live: {live()}\n{group.log()}"
    # A lone request on the idle group is prefilled at once: it waited for the ANY
    # point, ~100 empty steps of up to 50 ms each (~10 s), where one rank takes 0.1 s.
    started = time.monotonic()
    lone = client.answer(client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 4}))
    assert lone.ok and time.monotonic() - started < 4, group.log()
    prompts = [PROMPT[: 5 + i] for i in range(6)]
    rids = [
        client.submit(prompt_token_ids=p, sampling={"max_tokens": 12, **GREEDY}) for p in prompts
    ]
    try:
        answers = [client.answer(r) for r in rids]
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nengine log:\n{group.log()}") from None
    assert all(a.ok for a in answers)
    assert [a.token_ids for a in answers] == [reference(p, 12).token_ids for p in prompts]
    assert len(set().union(*(a.engines for a in answers))) == 2  # both ranks served
    # Each rank is a fresh interpreter that logs as the first does (it said nothing).
    assert f"engine {group.engine_id}-r1 ready" in group.log()
    # The group's process killed (a supervisor's SIGKILL forwards nothing): its ranks
    # go with it, as a pod's container takes every process in it, not left serving.
    # (Its children: the two ranks and multiprocessing's resource tracker.)
    children = process_tree.children(group.process.pid)
    assert len(children) >= 2, children
    group.kill()
    assert eventually(lambda: not any(map(process_tree.running, children)), 10), "orphans left"


def test_a_rank_that_fails_ends_its_whole_group(redis_url, keys, tmp_path):
    # Rank 1 serves HTTP on port + 1: taken, it fails at start. Its peer would wait in
    # the first vote for ever; the group must exit instead, so a supervisor restarts it.
    # Taken once the ranks were spawned: the engine's own check names a port taken
    # before the start (test_engine_cli.py), so the rank meets it only in a race.
    proc = EngineProcess("normal", redis_url, keys, ["--data-parallel-size", "2"], log_dir=tmp_path)
    proc.port = free_port_pair()
    proc.start()
    try:
        assert eventually(lambda: process_tree.children(proc.process.pid), timeout=60)
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", proc.port + 1))  # before the rank's load ends
            taken.listen()
            code = proc.process.wait(timeout=120)
    finally:
        proc.stop()
    assert code != 0, proc.log()
    assert "Address already in use" in proc.log()
    assert "rank-1 exited (code " in proc.log()  # which rank ended the group
    # Not its peer, however soon that one saw the broken vote and exited, and not
    # aborted in gloo's teardown.
    assert "rank-0 exited" not in proc.log() and "terminate called" not in proc.log()


def free_port_pair() -> int:
    """A port whose next one is free too."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port


def test_cancelling_a_running_request_frees_its_kv_at_once(engines, client, redis_url, keys):
    from tandem.engine.service.cancellation import cancel

    engine = engines("normal", *LONG)
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 2000, **GREEDY})
    events = client.events(rid, timeout=60)
    first = next(e for e in events if e.event == EventKind.TOKENS)  # it is decoding
    assert engine.metric("tandem_engine_kv_cache_usage") > 0
    conn = redis.Redis.from_url(redis_url)
    cancel(conn, keys, rid)
    conn.close()
    sent = len(first.token_ids)
    for event in events:
        if event.is_final:
            break
        sent += len(event.token_ids)
    assert event.error_code == ErrorCode.CANCELLED
    # As written (readers correct an offset behind them), it counts the tokens sent
    # before it (protocol.md): it said 0, as if none had been.
    with redis.Redis.from_url(redis_url) as conn:
        (_, raw), *_ = conn.xrevrange(keys.response_stream(rid), count=1)
    assert ResponseEvent.from_fields(raw).offset == sent > 0
    assert eventually(lambda: engine.metric("tandem_engine_kv_cache_usage") == 0)
    assert engine.metric("tandem_engine_requests_total", outcome="cancelled") == 1


def test_cancelling_a_request_whose_kv_is_offered_unpins_it_at_once(
    engines, client, redis_url, keys
):
    from tandem.engine.service.cancellation import cancel

    # No decoder yet: the prefilled KV waits in an offer (for a minute here).
    prompt = engines("prompt", "--handoff-ttl", "60")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 8, **GREEDY})
    assert eventually(lambda: prompt.metric("tandem_engine_kv_pinned_requests") == 1)
    assert prompt.metric("tandem_engine_kv_cache_usage") > 0
    conn = redis.Redis.from_url(redis_url)
    cancel(conn, keys, rid)
    # The client left, so no decoder will fetch it: freed within a step and a
    # heartbeat, not at the offer's expiry (it held the prompt engine's KV a minute).
    assert eventually(lambda: prompt.metric("tandem_engine_kv_pinned_requests") == 0, timeout=10)
    assert prompt.metric("tandem_engine_kv_cache_usage") == 0
    final = client.answer(rid, timeout=10).final  # the stream ends, after the first token
    assert (final.error_code, final.offset) == (ErrorCode.CANCELLED, 1)
    # A decoder that comes now acknowledges the handoff without fetching anything.
    decode = engines("completion")
    assert eventually(lambda: conn.xlen(keys.handoff_stream("tiny")) == 0)
    conn.close()
    assert decode.metric("tandem_engine_kv_transfer_bytes_total") == 0
    # Counted once, by the decoder that takes the handoff (no engine counted it): without
    # `handoff`, the engines' outcomes count each choice once, as docs/metrics.md says.
    ended = "tandem_engine_requests_total"
    assert eventually(lambda: decode.metric(ended, outcome="cancelled") == 1)
    assert prompt.metric(ended, outcome="cancelled") == 0
    assert prompt.metric(ended, outcome="handoff") == 1


def test_offered_kv_is_served_only_to_a_fetch_with_the_handoffs_token(
    engines, client, redis_url, keys
):
    import torch

    from tandem.engine.model.random_model import random_config
    from tandem.engine.service.kv_tcp import fetch_kv
    from tandem.engine.service.kv_transfer import KVLayout, KVTransferError

    # No decoder: the KV waits in an offer whose handle is the request id, which the
    # client and the logs know. Its token travels only in the Handoff, through Redis.
    prompt = engines("prompt", "--handoff-ttl", "60")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 8, **GREEDY})
    conn = redis.Redis.from_url(redis_url)
    # Offered (pinned) first, published once the step's events are flushed.
    assert eventually(lambda: conn.xlen(keys.handoff_stream("tiny")) == 1)
    assert prompt.metric("tandem_engine_kv_pinned_requests") == 1
    [(_, fields)] = conn.xrange(keys.handoff_stream("tiny"))
    conn.close()
    handoff = Handoff.from_fields(fields)
    assert handoff.kv_handle == rid and len(handoff.kv_token) >= 16
    config = random_config("tiny")
    layout = KVLayout(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, torch.float32
    )
    shape = (2, 4, 16, layout.num_kv_heads, layout.head_dim)
    caches = [torch.zeros(shape) for _ in range(layout.num_layers)]
    n = handoff.num_kv_tokens
    args = (handoff.fingerprint, n, torch.arange(n), caches, layout, 10.0)
    for guess in ("", rid, handoff.kv_token[:-1]):
        with pytest.raises(KVTransferError, match="unknown or expired") as refused:
            fetch_kv(handoff.kv_address, handoff.kv_handle, guess, *args)
        assert refused.value.reason == "refused"
    assert all(not c.any() for c in caches)  # no KV came
    assert prompt.metric("tandem_engine_kv_pinned_requests") == 1  # still on offer
    fetch_kv(handoff.kv_address, handoff.kv_handle, handoff.kv_token, *args)
    assert caches[0].any()
    # The fetch acknowledged it: freed, as after a decoder's fetch.
    assert eventually(lambda: prompt.metric("tandem_engine_kv_pinned_requests") == 0)


def test_a_request_cancelled_while_queued_is_counted_where_it_ends(
    engines, client, redis_url, keys
):
    from tandem.engine.service.cancellation import cancel

    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 8, **GREEDY})
    conn = redis.Redis.from_url(redis_url)
    cancel(conn, keys, rid)  # before any engine took it
    engine = engines("normal")
    assert eventually(lambda: sum(conn.xlen(s) for s in keys.work_streams("tiny")) == 0)
    conn.close()
    assert engine.metric("tandem_engine_requests_total", outcome="cancelled") == 1
    assert engine.metric("tandem_engine_steps_total") == 0  # and it never ran
    # Its stream ends: a gateway whose read missed the cancel stops reading.
    assert client.answer(rid, timeout=10).final.error_code == ErrorCode.CANCELLED


def test_the_waiting_tokens_integral_counts_a_prompt_from_pull_to_prefill(engines, client):
    # The autoscaler rates this counter into the mean tokens waiting; a prompt
    # waits from its pull to the end of its prefill step, so serving one adds to it.
    engine = engines("normal")
    name = "tandem_engine_waiting_prompt_token_seconds_total"
    assert engine.metric(name) == 0
    for _ in range(3):
        rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 2, **GREEDY})
        assert client.answer(rid).final.error_code is None
    served = engine.metric(name)
    assert served > 0
    time.sleep(0.5)  # idle: nothing waits, so the counter stands still
    assert engine.metric(name) == served


def test_an_entry_the_engine_cannot_read_is_answered_not_dropped(engines, client, keys):
    # A gateway of another protocol version, a hand-made entry: acked and dropped in
    # silence, its client waited out its whole deadline.
    engines("normal")
    stream = keys.work_stream("tiny", PRIORITY_NORMAL)
    data = '{"request_id": "no-prompt", "model": "tiny"}'
    client.redis.xadd(stream, {"v": str(PROTOCOL_VERSION), "kind": "work", "data": data})
    answer = client.answer("no-prompt", timeout=30)
    assert answer.final.error_code == ErrorCode.INVALID_REQUEST
    assert "the engine cannot read this request" in answer.final.error_message
    # Acked once answered (the answer first: an engine dying between leaves it pending).
    assert eventually(lambda: client.redis.xpending(stream, WORK_GROUP)["pending"] == 0)
    assert client.redis.xlen(stream) == 0


def test_a_request_past_its_deadline_ends_with_a_clear_error(engines, client):
    engine = engines("normal", *LONG)
    rid = client.submit(
        prompt_token_ids=PROMPT,
        sampling={"max_tokens": 2000, **GREEDY},
        deadline=time.time() + 0.3,
    )
    answer = client.answer(rid)
    assert answer.final.error_code == ErrorCode.DEADLINE_EXCEEDED
    assert "deadline" in answer.final.error_message
    assert len(answer.token_ids) < 2000
    assert eventually(lambda: engine.metric("tandem_engine_kv_cache_usage") == 0)


def test_a_request_whose_deadline_passed_in_the_queue_never_runs(engines, client):
    engine = engines("normal")
    rid = client.submit(
        prompt_token_ids=PROMPT,
        sampling={"max_tokens": 8, **GREEDY},
        deadline=time.time() - 1.0,
    )
    final = client.answer(rid).final
    assert final.error_code == ErrorCode.DEADLINE_EXCEEDED
    assert "in queue" in final.error_message
    assert engine.metric("tandem_engine_steps_total") == 0


def test_a_request_delivered_twice_runs_once(engines, client, keys, redis_url):
    engine = engines("normal")
    rid = client.submit(prompt_token_ids=PROMPT, sampling={"max_tokens": 8, **GREEDY})
    first = client.answer(rid)
    conn = redis.Redis.from_url(redis_url)
    # Queued again once enqueue's marker has expired (a producer retrying long after):
    # the engine must find the answer in the response stream and not run it again.
    assert conn.delete(keys.enqueued("tiny", rid)) == 1
    client.submit(request_id=rid, prompt_token_ids=PROMPT, sampling={"max_tokens": 8, **GREEDY})
    assert eventually(lambda: sum(conn.xlen(s) for s in keys.work_streams("tiny")) == 0)
    conn.close()
    assert client.answer(rid).token_ids == first.token_ids  # no token twice
    assert engine.metric("tandem_engine_requests_total") == 1


def test_a_request_whose_engines_keep_dying_fails_clearly(engines, client, keys, redis_url):
    from tandem.engine.service.work_queue import WorkQueue
    from tandem.protocol import Role

    conn = redis.Redis.from_url(redis_url)
    rid = client.submit(prompt_token_ids=PROMPT)
    # A consumer that takes the request and dies without a word.
    doomed = WorkQueue(conn, keys, "tiny", Role.NORMAL, "doomed", claim_idle_ms=100)
    assert len(doomed.pull(1).work) == 1
    engines("normal", "--claim-idle-ms", "300", "--max-deliveries", "1")
    final = client.answer(rid).final
    assert final.error_code == ErrorCode.REDELIVERY_LIMIT
    assert "not retrying" in final.error_message
    assert eventually(lambda: conn.xpending(keys.work_stream("tiny", 1), "engines")["pending"] == 0)
    conn.close()


def test_an_engine_restarted_under_its_id_resumes_what_it_held_at_once(
    engines, client, keys, redis_url
):
    from tandem.engine.service.work_queue import WorkQueue
    from tandem.protocol import Role

    conn = redis.Redis.from_url(redis_url)
    rid = client.submit(prompt_token_ids=PROMPT)
    # The engine "same" takes the request and dies; it comes back under its id (as
    # `tandem up` restarts engines). Its entry is no longer idle long enough for the
    # claim timeout, a minute here: the new process must not wait that out.
    assert len(WorkQueue(conn, keys, "tiny", Role.NORMAL, "same").pull(1).work) == 1
    started = time.monotonic()
    engine = engines("normal", "--engine-id", "same", "--claim-idle-ms", "60000")
    answer = client.answer(rid, timeout=30)
    assert answer.ok and answer.engines == {"same"}
    assert time.monotonic() - started < 45
    assert "left unfinished go back to the queue" in engine.log()
    assert eventually(lambda: conn.xpending(keys.work_stream("tiny", 1), "engines")["pending"] == 0)
    conn.close()


def test_preemptions_are_said_in_the_log(engines, client):
    # Only /metrics told of a KV cache too small for the load: the log said nothing.
    engine = engines("normal", "--num-kv-blocks", "8", "--max-model-len", "128")
    sampling = {"max_tokens": 60, **GREEDY}
    rids = [client.submit(prompt_token_ids=PROMPT, sampling=sampling) for _ in range(4)]
    for rid in rids:  # 4 x ~70 tokens in 128 of KV: some wait their turn, preempted
        assert client.answer(rid, timeout=60).final.error_code is None
    assert engine.metric("tandem_engine_preemptions_total") > 0
    said = [line for line in engine.log().splitlines() if "preempted (the KV cache" in line]
    assert said and " INFO " in said[0], engine.log()
