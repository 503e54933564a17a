"""The embedded Redis of `tandem up`: started fresh in its run folder, and restarted
with the data it had when it dies (its append-only file)."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import redis

from tandem.preflight import StartError
from tandem.redis_server import RedisServer


def start_embedded(folder: Path) -> RedisServer:
    """A Redis keeping an append-only file in `folder`: restarted after a crash, it still
    has the queued requests (and streams, registry) it had. StartError if it cannot start."""
    # A password of its own: any user of the machine reaches 127.0.0.1, and without it
    # could read every prompt and answer, or queue work past the gateway's key.
    password = secrets.token_urlsafe(24)
    server = RedisServer(data_dir=folder, appendonly=True, die_with_us=True, password=password)
    # Fresh for each run: a reused --log-dir's file would replay a finished run's
    # queue, whose clients are long gone. Only Redis' files: the folder is the user's.
    server.discard_saved_data()
    try:
        return server.start()
    except RuntimeError as exc:
        raise StartError(f"the embedded Redis did not start: {exc}") from None


def restart_if_dead(server: RedisServer, say: Callable[[str], None]) -> str | None:
    """Restart `server` if it died, saying what it comes back with; why it could not
    (nothing can recover: the stack stops), else None."""
    if server.alive:
        return None
    if server.has_saved_data():
        kept = (
            "from its append-only file (queued requests are kept; at worst those of its "
            "last second are lost, and the gateway queues those again; engines reconnect)"
        )
    else:
        kept = (
            "empty: its append-only file is gone (the gateway queues the requests it "
            "holds again; engines reconnect)"
        )
    say(f"redis exited ({server.returncode}); restarting it on port {server.port} {kept}")
    try:
        server.start()
    except (RuntimeError, OSError, redis.RedisError) as exc:  # the port taken, a full disk
        say(f"redis could not restart: {exc}; stopping")
        return f"the embedded Redis could not restart: {exc}"
    return None
