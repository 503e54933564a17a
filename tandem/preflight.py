"""What `tandem up` checks before it starts anything, and the error it raises when it cannot start.

A port in use or a Redis that does not answer would otherwise show as a child
that dies while starting, after the others were started for nothing.
"""

from __future__ import annotations

import errno
import socket

import redis

from tandem.context_window import past_positions
from tandem.redaction import check_redis_url, redacted


class StartError(RuntimeError):
    """The stack could not start (what had started was stopped); str() says why, what to do."""


def check_port(host: str, port: int, *, flag: str = "--port", who: str = "the gateway") -> None:
    """StartError unless `who` could listen on host:port (set by `flag`)."""
    try:  # as the servers bind: SO_REUSEADDR, IPv6 for an address with ':'
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartError(
                f"port {port} on {host} is already in use (another `tandem up`?): "
                f"stop what listens there, or choose another {flag}"
            ) from None
        raise StartError(
            f"{who} cannot listen on {host}:{port}: {exc.strerror or exc}; "
            f"choose another --host or {flag}"
        ) from None


def check_redis(url: str) -> None:
    """StartError unless the Redis at `url` (--redis-url) answers."""
    try:
        check_redis_url(url, "--redis-url")
    except ValueError as exc:
        raise StartError(str(exc)) from None
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5) as client:
            client.ping()
    except redis.RedisError as exc:
        raise StartError(
            f"cannot reach Redis at {redacted(url)} (--redis-url, or $TANDEM_REDIS_URL): "
            f"{str(exc).rstrip('.')}; start it, or give neither to run an embedded one"
        ) from None


def check_model(spec: str) -> None:
    """StartError unless `spec` names a model of a form an engine loads, a folder with
    its config.json and weights (what they hold is the engine's to check). A role
    autoscaled from zero started its first engine only at the first request, which then
    crash-looped on a path that is not there while the request waited."""
    # Here, not at the top: the gateway imports this module, and of the engine only
    # its SamplingParams (tandem/protocol.py's contract).
    from tandem.engine.model.model_spec import spec_problem, weights_problem

    if (problem := spec_problem(spec) or weights_problem(spec)) is not None:
        raise StartError(problem)


def check_max_model_len(spec: str, max_model_len: int | None, where: str) -> None:
    """StartError for a max_model_len (set at `where`) past the model's positions, where
    they are cheap to read: as check_model, a role autoscaled from zero crash-looped on
    it only at the first request, which waited out its deadline."""
    from tandem.engine.model.model_spec import declared_positions

    positions = declared_positions(spec)
    if max_model_len is None or positions is None:
        return
    if (why := past_positions(max_model_len, positions)) is not None:
        raise StartError(f"{where}: {why}")
