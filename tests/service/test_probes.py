"""/healthz and /readyz as functions of the worker's state (engine_image/.../probes.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tandem.engine.service import probes


def worker(*, last_loop_at=100.0, registered=True, draining=False, down=False):
    return SimpleNamespace(
        last_loop_at=last_loop_at,
        settings=SimpleNamespace(stall_limit=120.0),
        heartbeat=SimpleNamespace(registered=registered),
        draining=draining,
        outage=SimpleNamespace(down=down, seconds=lambda: 7.0),
    )


def test_a_loading_engine_is_live_and_not_ready():
    assert probes.live(None) == (True, "starting")
    assert probes.ready(None, lambda: True) == (False, "starting")


def test_a_turning_registered_engine_with_redis_is_ready():
    assert probes.ready(worker(), lambda: True, now=101.0) == (
        True,
        "model loaded, redis reachable",
    )
    assert probes.ready(worker(), lambda: False, now=101.0) == (False, "redis unreachable")


def test_a_stalled_loop_is_neither_live_nor_ready():
    # A rank waiting at the group's vote on a hung peer: its heartbeat stopped and its
    # registry entry expired, yet /readyz said 200, so the pod counted as serving.
    stalled = worker(last_loop_at=0.0)
    assert probes.live(stalled, now=130.0) == (False, "last loop 130.0s ago")
    ok, why = probes.ready(stalled, lambda: True, now=130.0)
    assert not ok and why == "the loop is stalled (last loop 130.0s ago)"


def test_draining_unregistered_or_cut_off_engines_are_not_ready():
    assert probes.ready(worker(draining=True), lambda: True, now=101.0) == (False, "draining")
    unregistered = probes.ready(worker(registered=False), lambda: True, now=101.0)
    assert unregistered == (False, "not yet in the registry")
    assert probes.ready(worker(down=True), lambda: True, now=101.0) == (
        False,
        "redis unreachable for 7s",
    )
