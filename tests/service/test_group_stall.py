"""A data-parallel decode group whose requests all wait for their KV waits quietly, as one
engine does: real `tandem engine`s, the prompt engine frozen once it offered the KV."""

import os
import signal
import time

from support.polling import eventually

from tandem.protocol import HANDOFF_GROUP, PRIORITY_NORMAL


def _commands(redis) -> int:
    return sum(stat["calls"] for stat in redis.info("commandstats").values())


def _cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


def _ranks(group) -> list[int]:
    pid = group.process.pid
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]


def test_a_decode_group_waiting_for_kv_neither_spins_nor_floods_redis(engines, client):
    # Each rank went round its loop with no pause (a pull, a vote, an empty step):
    # 5.4 s of CPU in 6 s and 52,000 Redis commands, where one engine ran 1,600.
    prompt = engines("prompt", "--handoff-ttl", "60")
    sampling = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    rids = client.submit_burst(4, prompt_token_ids=list(range(1, 40)), sampling=sampling)
    stream = client.keys.work_stream(client.model, PRIORITY_NORMAL)
    assert eventually(lambda: client.redis.xlen(stream) == 0, 60)  # all prefilled, offered
    prompt.process.send_signal(signal.SIGSTOP)  # the decoders' fetches hang
    try:
        group = engines("completion", "--data-parallel-size", "2", "--kv-fetch-timeout", "60")
        handoffs = client.keys.handoff_stream(client.model)
        taken = lambda: client.redis.xpending(handoffs, HANDOFF_GROUP)["pending"]  # noqa: E731
        assert eventually(lambda: taken() == 4, 60), group.log()
        time.sleep(0.5)  # their fetches begun
        ranks = _ranks(group)
        cpu, commands = _cpu_s(ranks), _commands(client.redis)
        time.sleep(3)
        cpu, commands = _cpu_s(ranks) - cpu, _commands(client.redis) - commands
    finally:
        prompt.process.send_signal(signal.SIGCONT)
    # Measured: ~2,000 commands and ~1 s of CPU here (25,000 and 2.6 s before).
    assert commands < 6000, commands
    assert cpu < 2.0, cpu  # of the 6 s two ranks had
    # And they decode once the KV comes.
    for rid in rids:
        assert client.answer(rid, timeout=60).final.event == "finish", group.log()
