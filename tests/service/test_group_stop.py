"""How a data-parallel group stops: asked while loading, with a rank that hangs, and
on a bad setting its ranks find once loaded, and when a rank dies. Real two-rank groups
of `tandem engine`."""

import os
import signal
import time
from pathlib import Path

import pytest
from support.engines import EngineProcess
from support.polling import eventually

from tandem.engine.service.ranks import (
    PEER_ENDED_CODE,
    PEERS_HAND_BACK_S,
    STOP_MARGIN_S,
    _end_group,
    rank_device,
)
from tandem.engine.service.registry import Registry
from tandem.protocol import PRIORITY_NORMAL, WORK_GROUP, as_text


def _ranks(group: EngineProcess) -> list[int]:
    """The group's rank processes (spawned interpreters; not the resource tracker)."""
    pid = group.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(child)
        for child in children
        if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text(errors="replace")
    ]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_group_asked_to_stop_while_loading_stops_cleanly(start_group, signum):
    # A rank whose SIGTERM handler is not set yet dies of the signal: the group logged
    # it as a failure and exited 1, as if it had crashed (a scale-down mid-load). A
    # terminal's Ctrl-C (SIGINT to the group and to every rank) raised KeyboardInterrupt
    # in the ranks' imports: tracebacks, an abort, and "ending the group".
    group = start_group()
    assert eventually(lambda: len(_ranks(group)) == 2, timeout=60), group.log()
    for pid in [group.process.pid, *_ranks(group)]:
        os.kill(pid, signum)
    code = group.process.wait(timeout=60)
    assert code == 0, group.log()
    assert "ending the group" not in group.log()
    assert "Traceback" not in group.log() and "terminate called" not in group.log()


def test_a_group_with_a_hung_rank_stops_within_its_drain_and_margin(start_group, client):
    # A rank stuck (a hung kernel; here, stopped) holds its peer in a vote: neither
    # reads its drain flag, and the group ignored SIGTERM until the kubelet's SIGKILL,
    # which says nothing in the log.
    group = start_group("--drain-timeout", "1")
    try:
        group.wait_ready(timeout=120)
        ids = {group.engine_id, f"{group.engine_id}-r1"}
        registry = Registry(client.redis, client.keys)
        assert eventually(lambda: ids <= {e.engine_id for e in registry.live()}, 120)
        rank_1 = _ranks(group)[1]
        os.kill(rank_1, signal.SIGSTOP)
        client.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4})
        time.sleep(1)  # rank 0 waits in a vote now, or in the queue
        asked = time.monotonic()
        group.process.send_signal(signal.SIGTERM)
        code = group.process.wait(timeout=1 + STOP_MARGIN_S + 30)
        took = time.monotonic() - asked
    finally:
        for pid in _ranks(group) if group.process.poll() is None else []:
            os.kill(pid, signal.SIGCONT)
        group.stop()
    assert code == 1, group.log()
    assert took >= 1 + STOP_MARGIN_S - 1, took  # not before the drain and its margin
    assert "rank-1" in group.log() and "did not stop within 16 s" in group.log()
    assert eventually(lambda: not Path(f"/proc/{rank_1}").exists() or _zombie(rank_1), 10)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_setting_the_ranks_refuse_once_loaded_is_one_error_line(start_group):
    # A KV pool too small for max_model_len is found after the model loads: one rank
    # says `tandem: error: ...` and exits 2; each rank of a group printed a traceback and
    # the group exited 1, and the pod's message (its last log lines) quoted its tail.
    group = start_group("--num-kv-blocks", "4")
    code = group.process.wait(timeout=120)
    log = group.log()
    assert code == 2, log
    assert "tandem: error: 4 KV blocks of 16 tokens hold 64 tokens" in log
    assert "Traceback" not in log


def test_when_a_rank_dies_its_peer_hands_back_what_it_holds(start_group, client):
    # The group killed the healthy ranks at once with the failed one: their requests
    # waited --claim-idle-ms (30 s) for another engine, ready seconds after the crash.
    group = start_group()
    group.wait_ready(timeout=120)
    sampling = {"max_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
    client.submit_burst(8, prompt_token_ids=[1, 2, 3], sampling=sampling)
    peer = f"{group.engine_id}-r1"
    assert eventually(lambda: len(client.held()) == 2, timeout=30), (client.held(), group.log())
    os.kill(_ranks(group)[0], signal.SIGKILL)
    code = group.process.wait(timeout=PEERS_HAND_BACK_S + 30)
    log = group.log()
    assert code != 0 and "rank-0 exited (signal 9): ending the group" in log, log
    stream = client.keys.work_stream(client.model, PRIORITY_NORMAL)
    held = client.redis.xpending_range(stream, WORK_GROUP, "-", "+", 100)
    peers = [p for p in held if as_text(p["consumer"]) == peer]
    assert peers, held
    # Handed back: idle past any --claim-idle-ms, so the next engine to pull takes them.
    assert all(p["time_since_delivered"] > 3600 * 1000 for p in peers), peers
    assert f"a peer rank ended: handed {len(peers)} requests back" in log, log
    assert "Traceback" not in log, log


class _Rank:
    """A rank process as the group sees it, which ends when joined."""

    def __init__(self, name: str, exitcode: int | None, ends_with: int | None = None):
        self.name, self.exitcode, self._ends_with = name, exitcode, ends_with

    def join(self, timeout: float | None = None) -> None:
        if self._ends_with is not None:
            self.exitcode = self._ends_with

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.exitcode = -signal.SIGKILL


def test_the_group_names_the_failed_rank_not_the_peer_reaped_before_it(caplog):
    # The failed rank's sockets close as it exits: its peer's vote breaks and the peer
    # may exit before the failed one is reaped. The group named the peer ("rank-0
    # exited (signal 6)", gloo aborting in its teardown), seen as a CI failure.
    peer = _Rank("rank-0", PEER_ENDED_CODE)
    failed = _Rank("rank-1", None, ends_with=1)
    with caplog.at_level("ERROR", logger="tandem.engine"):
        code = _end_group([peer, failed], [peer], stopped=(0,))
    assert code == 1
    assert caplog.messages == ["rank-1 exited (code 1): ending the group"]


def test_more_ranks_than_gpus_is_the_loaders_error_not_cudas(monkeypatch):
    # torch.cuda.set_device(cuda:1) on a one-GPU host ran before the loader's check:
    # a CUDA traceback ("invalid device ordinal") and exit 1, not one error line.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_device(None, 0) == "cuda:0"
    assert rank_device("cuda", 0) == "cuda:0"
    assert rank_device("cuda:0", 1) == "cuda:0"  # one GPU shared on purpose
    assert rank_device("cpu", 1) == "cpu"
    with pytest.raises(ValueError, match="lower --data-parallel-size"):
        rank_device(None, 1)
