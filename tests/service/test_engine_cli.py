"""`tandem engine`'s flags: a value no engine could start with, or a Redis it cannot
reach, is one clean error before the model loads (minutes, for a big model)."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.service.arguments import add_arguments, engine_fields, worker_fields
from tandem.engine.service.settings import WorkerSettings
from tandem.redaction import redacted
from tandem.redis_server import RedisServer, free_port

TANDEM = str(Path(sys.executable).with_name("tandem"))


def _engine(*flags: str) -> subprocess.CompletedProcess[str]:
    # A model path that does not exist: an error about it would mean it was loaded first.
    command = [TANDEM, "engine", "--model", "/no/such/model", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "99999"], "--port must leave a port per rank below 65536, got 99999"),
        (["--port", "0"], "--port must be at least 1, got 0"),
        (
            ["--kv-port", "65535", "--data-parallel-size", "2"],
            "--kv-port must leave a port per rank below 65536, got 65536",
        ),
        (["--num-kv-blocks", "0"], "--num-kv-blocks must be at least 1, got 0"),
        (["--max-waiting", "0"], "--max-waiting must be at least 1, got 0"),
        (["--drain-timeout", "nan"], "--drain-timeout must be 0 or more seconds, got nan"),
        (["--kv-fetch-timeout", "0"], "--kv-fetch-timeout must be a finite number > 0, got 0.0"),
        (["--handoff-ttl", "inf"], "--handoff-ttl must be a finite number > 0, got inf"),
        (["--key-prefix", ""], "--key-prefix must be non-empty without braces or spaces, got ''"),
        # An empty id was replaced by a generated one: a restart under it resumed nothing.
        (["--engine-id", ""], "--engine-id must be non-empty without spaces, got ''"),
        (["--redis-wait", "-1"], "--redis-wait must be 0 or more seconds, got -1.0"),
        # Not echoed: a spec.redis.urlSecretRef may point at any Secret's value.
        (["--redis-url", "hunter2"], "--redis-url is not a Redis URL: redis://[[user]:pass"),
        # redis-py's reason quoted the password's first half ("as 'Xk9f'").
        (["--redis-url", "redis://:Xk9f/p7@h:6379/0"], "percent-encode any /, ?, # or @ in"),
        # The engine's settings, named by their flags (a ZeroDivisionError after the
        # model loaded, a traceback from every rank of a data-parallel group).
        (["--block-size", "0"], "--block-size must be at least 1, got 0"),
        # An empty name was served as --model's; braces break the streams' hash tag.
        (
            ["--served-model-name", ""],
            "--served-model-name: a served model name must be non-empty and hold no braces",
        ),
        (["--served-model-name", "a{b}"], "hold no braces (it keys the model's Redis streams)"),
        (
            ["--num-speculative-tokens", "-1", "--data-parallel-size", "2"],
            "--num-speculative-tokens must be at least 0, got -1",
        ),
        # torch's own overflow check named no flag.
        (["--threads", str(2**63)], f"--threads must be at most 4096, got {2**63}"),
        (["--seed", str(2**64)], f"--seed must be in 0..2**63-1, got {2**64}"),
        # Tracebacks once the model had loaded (an engine binds after the load).
        (["--host", "999.1.1.1"], "the engine cannot listen on 999.1.1.1:8100"),
        (
            ["--max-model-len", "300", "--max-num-batched-tokens", "200"],
            "--max-num-batched-tokens (200) is smaller than --max-model-len (300): without "
            "chunked prefill a prompt of --max-model-len tokens could never be scheduled. "
            "Raise the budget, lower --max-model-len, or set --enable-chunked-prefill.",
        ),
    ],
)
def test_a_flag_no_engine_could_start_with_is_named(flags, message):
    done = _engine(*flags)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("tandem: error: ") and message in line


def test_a_port_in_use_is_named_before_the_model_loads():
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        for flags, flag in (
            (["--port", str(port)], "--port"),
            (["--role", "prompt", "--port", str(free_port()), "--kv-port", str(port)], "--kv-port"),
        ):
            done = _engine(*flags)
            assert done.returncode == 2, done.stderr
            [line] = done.stderr.strip().splitlines()
            assert line == (
                f"tandem: error: port {port} on 0.0.0.0 is already in use (another `tandem "
                f"up`?): stop what listens there, or choose another {flag}"
            )


@pytest.mark.parametrize(
    ("flags", "shared", "ranks"),
    [
        (["--port", "18150", "--kv-port", "18150"], 18150, ""),
        # Rank 1's HTTP port is rank 0's KV port.
        (["--port", "18150", "--kv-port", "18151", "--data-parallel-size", "2"], 18151,
         " (a port per rank, 2 ranks)"),
    ],
)  # fmt: skip
def test_the_http_and_kv_ports_may_not_overlap(flags, shared, ranks):
    # Each was free alone: the KV server failed with a traceback once the model loaded.
    done = _engine("--role", "prompt", *flags)
    assert done.returncode == 2, done.stderr
    port, kv_port = flags[1], flags[3]
    assert done.stderr.strip() == (
        f"tandem: error: --port {port} and --kv-port {kv_port} both take port {shared}{ranks}: "
        "give them ports apart"
    )


def test_a_redis_refusing_the_password_is_named_at_once():
    # Retried for the whole --redis-wait (60 s) as if Redis were still starting, and
    # without a password in the URL, in redis-py's words ("HELLO must be called ...").
    with RedisServer(password="S3cret") as server:
        shown = f"redis://127.0.0.1:{server.port}/0"
        for url, what in (
            (shown, "asks for a password, and none is in"),
            (f"redis://:wrong@127.0.0.1:{server.port}/0", "refused the password of"),
        ):
            done = _engine("--redis-url", url, "--redis-wait", "30")
            assert done.returncode == 1, done.stderr
            assert done.stderr.strip().splitlines()[-1] == (
                f"tandem: error: Redis at {redacted(url)} {what} --redis-url ($TANDEM_REDIS_URL)"
            )
            assert "waiting for Redis" not in done.stderr and "wrong" not in done.stderr


def test_an_unreachable_redis_is_named_before_the_model_loads():
    port = free_port()
    done = _engine("--redis-url", f"redis://:S3cret@127.0.0.1:{port}/0", "--redis-wait", "1.5")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    shown = f"redis://:***@127.0.0.1:{port}/0"
    assert f"tandem: error: cannot reach Redis at {shown} (--redis-url)" in done.stderr
    assert "waiting for Redis" in done.stderr  # it retried for --redis-wait first
    # A pod's last log lines are its termination message, quoted in the model's status.
    assert "S3cret" not in done.stderr


def test_help_shows_the_defaults():
    done = subprocess.run(
        [TANDEM, "engine", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    text = " ".join(done.stdout.split())  # argparse wraps lines anywhere
    for flag, default in [
        ("--port", 8100),
        ("--role", "normal"),
        ("--max-num-seqs", EngineConfig.max_num_seqs),
        ("--block-size", EngineConfig.block_size),
        ("--claim-idle-ms", WorkerSettings.claim_idle_ms),
        ("--drain-timeout", WorkerSettings.drain_timeout),
    ]:
        # The flag's own help (up to the next flag) ends in its default.
        assert re.search(rf"{flag} \S+ ((?! --).)*\(default: {default}\)", text), flag
    assert "(default: None)" not in text  # such a flag's help says what happens instead


def test_flags_default_to_the_settings_own_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert EngineConfig(**engine_fields(args)) == EngineConfig()
    names = dict(role=args.role, model_name="m", engine_id="e", http_address="a:1")
    flagged = WorkerSettings(**names, **worker_fields(args))
    assert flagged == WorkerSettings(**names, started_at=flagged.started_at)


def test_engines_seed_unseeded_draws_apart_unless_told():
    # Every engine and rank seeded 0: replicas behind one gateway gave the same
    # "random" answers in turn. None: each draws its seed from the OS (Sampler).
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).seed is None
    assert parser.parse_args(["--seed", "7"]).seed == 7


def test_a_bad_flag_is_answered_before_torch_loads():
    # torch alone took ~2 s to import before a typo was named.
    command = [sys.executable, "-X", "importtime", "-m", "tandem.cli", "engine", "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--port must be at least 1" in done.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "tandem.engine.service.registry" in imported  # main.py ran: the listing is real
    assert "torch" not in imported
