"""`tandem engine`: check the flags and Redis, then run one engine process (or one per
data-parallel rank). torch loads only past the checks: a bad flag is answered at once,
not after seconds of imports."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import time
import uuid

import redis

from tandem.engine.service.arguments import add_arguments, check_arguments, check_ports
from tandem.engine.service.logs import log_to_stderr
from tandem.engine.service.ranks import run_ranks
from tandem.engine.service.registry import Registry
from tandem.engine.service.settings import WorkerSettings
from tandem.keys import Keys
from tandem.listen import every_interface
from tandem.process_tree import descendants
from tandem.redaction import check_redis_url, password_given, redacted, refused_credentials

log = logging.getLogger("tandem.engine")


def main(args: argparse.Namespace) -> int:
    log_to_stderr()
    # Until serve() takes it as a drain, once loaded: a scale-down mid-load killed the
    # engine by the signal (exit 143), its log saying nothing.
    signal.signal(signal.SIGTERM, _stopped_while_starting)
    args.host = every_interface(args.host)  # "::" in a pod of an IPv6 cluster
    check_arguments(args)
    check_ports(args)
    wait_for_redis(args.redis_url, args.redis_wait)
    if args.engine_id is not None:
        refuse_a_live_namesake(args.redis_url, Keys(prefix=args.key_prefix), args.engine_id)
    else:
        # Chosen once, before the ranks start: rank r > 0 is "<id>-r<r>" of the same id.
        host, suffix = socket.gethostname(), uuid.uuid4().hex[:6]
        args.engine_id = f"{args.role}-{host}-{suffix}"
    from tandem.engine.service.serve import serve  # torch, the model's stack

    if args.data_parallel_size > 1:
        return run_ranks(args, serve)  # which takes SIGTERM itself
    return serve(args, rank=0)


def _stopped_while_starting(signum: int, _frame: object) -> None:
    log.info("stopped while starting (%s): nothing was taken", signal.Signals(signum).name)
    sys.stderr.flush()
    # A C++ kernel build's ninja and compilers, which would outlive us (and our lock on
    # the build's folder) and race the next engine's build into the same folder.
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    # Not SystemExit: raised in Python code that C++ called (torch's imports run some),
    # it was swallowed (loading went on, the stop lost) or aborted the process (pybind11's
    # terminate, SIGABRT). Nothing is registered or taken before serve() runs: nothing to
    # undo, and the sockets go with the process.
    os._exit(0)


def wait_for_redis(url: str, wait_s: float) -> None:
    """Until Redis answers, for up to wait_s: SystemExit naming the URL if it never does.

    Checked before the model loads, so a wrong URL costs seconds, not a model load.
    """
    # Neither the URL nor redis-py's reason is echoed: it may be any Secret's value.
    check_redis_url(url, "--redis-url")
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    deadline = time.monotonic() + wait_s
    with client:
        while True:
            try:
                client.ping()
                return
            except redis.AuthenticationError:
                # No waiting: a wrong password stays wrong (it cost --redis-wait a start).
                why = refused_credentials(password_given(client))
                raise SystemExit(f"tandem: error: Redis at {redacted(url)} {why}") from None
            except redis.RedisError as exc:
                if time.monotonic() >= deadline:
                    raise SystemExit(
                        f"tandem: error: cannot reach Redis at {redacted(url)} (--redis-url): {exc}"
                    ) from None
                # Its last lines become the pod's termination message, then the model's
                # status: never the password.
                log.info("waiting for Redis at %s: %s", redacted(url), exc)
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def refuse_a_live_namesake(url: str, keys: Keys, engine_id: str) -> None:
    """SystemExit if an engine with this id still beats: both served every request (each
    took the other's entries as a dead namesake's), a sampled answer a mix of the two,
    and the first to stop took the other's registry entry with it. An entry whose engine
    died (a restart under the same id) beats no more: one heartbeat's wait tells them
    apart. Checked before the model loads."""
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
    with client:
        registry = Registry(client, keys)
        try:
            first = registry.entry(engine_id)
            if first is None:
                return
            time.sleep(1.5 * WorkerSettings.heartbeat_every)
            now = registry.entry(engine_id)
        except redis.RedisError:
            return  # Redis went away again: the engine waits for it in its loop
    if now is not None and now.heartbeat_at != first.heartbeat_at:
        raise SystemExit(
            f"tandem: error: engine id {engine_id!r} (--engine-id) is taken by a live "
            f"engine (http {now.http_address}, started {time.ctime(now.started_at)}): "
            "give each engine an id of its own"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tandem engine")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
