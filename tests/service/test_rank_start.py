"""A data-parallel rank starts serving only once every rank has loaded its model.

The rank runs `serve` in its own process, as a group's rank does, with a vote this
test holds: the group's first vote stands for a peer still loading.
"""

import sys
import urllib.error
import urllib.request

from support.engines import EngineProcess
from support.polling import eventually

from tandem.engine.service.registry import Registry

# One rank of a group: its first vote waits until the test writes <folder>/go.
RANK = """
import argparse, pathlib, sys, time
from tandem.engine.service.arguments import add_arguments
from tandem.engine.service.serve import serve

folder = pathlib.Path(sys.argv[1])
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args(sys.argv[2:])
votes = []

def vote(value):
    if not votes:
        (folder / "voting").touch()
        while not (folder / "go").exists():
            time.sleep(0.05)
    votes.append(value)
    return value

raise SystemExit(serve(args, rank=0, vote=vote))
"""


def test_a_rank_registers_only_once_its_peers_have_loaded(redis_url, keys, client, tmp_path):
    rank = EngineProcess("normal", redis_url, keys, log_dir=tmp_path)
    rank.start_command([sys.executable, "-c", RANK, str(tmp_path), *rank.flags()])
    registry = Registry(client.redis, client.keys)
    try:
        assert eventually(lambda: (tmp_path / "voting").exists(), 120), rank.log()
        # Its model loaded, a peer's not: out of the registry, and not ready.
        assert registry.live() == []
        assert _readyz(rank) == (503, "not ready: starting")
        (tmp_path / "go").touch()
        rank.wait_ready(timeout=60)
        [entry] = registry.live()
        assert entry.engine_id == rank.engine_id
        request = client.submit(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 2})
        assert client.answer(request).ok, rank.log()
        assert rank.terminate() == 0, rank.log()
    finally:
        rank.stop()


def _readyz(rank: EngineProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(rank.url("/readyz"), timeout=5) as resp:
            return resp.status, resp.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()
