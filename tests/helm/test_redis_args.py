"""The chart's Redis, run: the real redis-server started with the StatefulSet's own
arguments answers as the chart means it to."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import redis
from support.helm import RELEASE, named
from support.polling import eventually

from tandem.redis_server import find_redis_server, free_port


def _redis_args(manifests: list[dict[str, Any]], data: Path, password: str) -> list[str]:
    statefulset = named(manifests, "StatefulSet", f"{RELEASE}-redis")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["redis-server"]
    args = [a.replace("$(REDIS_PASSWORD)", password) for a in container["args"]]
    return [str(data) if a == "/data" else a for a in args]


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_the_charts_redis_keeps_its_data_in_the_append_only_file_alone(renders, tmp_path):
    # With Redis' default snapshot schedule beside the AOF, one failed snapshot (its fork
    # OOM-killed in the 1Gi container, say) stopped every write: MISCONF, a 503 for every
    # request, though the append-only file was fine.
    port = free_port()
    args = _redis_args(renders["defaults-values"], tmp_path, "pw")
    server = subprocess.Popen(
        [str(find_redis_server()), *args, "--port", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, password="pw", decode_responses=True)
    try:
        assert eventually(lambda: _answers(client), timeout=5), "redis-server did not start"
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("maxmemory")["maxmemory"] == str(768 * 1024 * 1024)
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=10)
