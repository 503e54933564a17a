"""The embedded Redis (tandem/redis_server.py) in the folders and ports it is given."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import redis

from tandem import redis_server
from tandem.redis_server import APPEND_ONLY_FILE, RedisServer


def test_discarding_saved_data_removes_redis_files_and_nothing_else(tmp_path: Path) -> None:
    # tandem up --log-dir DIR keeps its Redis in DIR/redis: a folder that may be the user's.
    data = tmp_path / "redis"
    (data / "appendonlydir").mkdir(parents=True)
    (data / "appendonlydir" / "appendonly.aof.1.base.rdb").write_bytes(b"REDIS")
    (data / APPEND_ONLY_FILE).write_bytes(b"*1\r\n")
    (data / "temp-rewriteaof-42.aof").write_bytes(b"")
    (data / "important.txt").write_text("mine")
    RedisServer(data_dir=data).discard_saved_data()
    assert [p.name for p in data.iterdir()] == ["important.txt"]
    RedisServer(data_dir=tmp_path / "none").discard_saved_data()  # nothing there: no error


def test_a_port_held_by_something_that_never_answers_fails_the_start_in_time(
    tmp_path: Path,
) -> None:
    # Its port taken between a crash and the restart: the ping waited without end (or
    # raised a TimeoutError through tandem up's supervisor).
    with socket.create_server(("127.0.0.1", 0)) as silent:
        server = RedisServer(port=silent.getsockname()[1], data_dir=tmp_path)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="redis-server"):
            server.start(timeout=3)
    assert time.monotonic() - started < 10


def test_a_port_taken_is_the_reason_it_could_not_start(tmp_path: Path) -> None:
    # Redis says so in its log, not on stderr: tandem up said "redis-server exited: ".
    with socket.create_server(("127.0.0.1", 0)) as taken:
        server = RedisServer(port=taken.getsockname()[1], data_dir=tmp_path)
        with pytest.raises(RuntimeError, match="Address already in use"):
            server.start(timeout=10)


def test_a_relative_data_folder_is_taken_from_where_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `tandem up --log-dir logs`: Redis entered logs/redis, then looked for its log
    # file in logs/redis/logs/redis, and did not start.
    monkeypatch.chdir(tmp_path)
    server = RedisServer(data_dir=Path("logs") / "redis")
    try:
        server.start(timeout=30)
        assert redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()
    assert (tmp_path / "logs" / "redis" / "redis.log").is_file()


def test_a_restart_waits_for_as_long_as_redis_loads_its_append_only_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loading takes time with the file's size (half a gigabyte: over 10 s): the start
    # gave up at its timeout, stopped the loading server, and tandem up stopped with
    # every request it held. Here each key takes 20 ms to load: 2 s for 100, the start's
    # timeout 1 s.
    server = RedisServer(data_dir=tmp_path / "redis", appendonly=True)
    with server:
        client = redis.Redis.from_url(server.url)
        client.mset({f"k{i}": "x" * 65536 for i in range(100)})  # 6 MiB
        client.bgrewriteaof()  # the keys in its RDB preamble, which the delay slows
        while client.info("persistence")["aof_rewrite_in_progress"]:
            time.sleep(0.05)
        client.close()
    real = redis_server.find_redis_server()
    slow = tmp_path / "slow-redis-server"
    # (A loading Redis 6 answers, LOADING, after each 2 MiB it reads: every 32 keys.)
    slow.write_text(f'#!/bin/sh\nexec "{real}" "$@" --key-load-delay 20000\n')
    slow.chmod(0o755)
    monkeypatch.setattr(redis_server, "find_redis_server", lambda: slow)
    started = time.monotonic()
    with server.start(timeout=1):
        assert time.monotonic() - started > 1.5  # it did load for longer than the timeout
        assert redis.Redis.from_url(server.url).dbsize() == 100
