"""free_port: local ports for engines, whose data-parallel ranks listen on port + rank."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tandem import redis_server
from tandem.redis_server import free_port


@pytest.mark.parametrize("count", [1, 4])
def test_the_port_and_the_ones_after_it_can_be_bound(count):
    base = free_port(count)
    sockets = [socket.socket() for _ in range(count)]
    try:
        for i, s in enumerate(sockets):
            s.bind(("127.0.0.1", base + i))
    finally:
        for s in sockets:
            s.close()


def test_a_run_with_a_taken_port_is_not_returned(monkeypatch):
    # The first port checked after a candidate is taken (by someone else, say):
    # that candidate must be dropped for another.
    taken: set[int] = set()
    bindable = redis_server._bindable

    def first_one_taken(port: int) -> bool:
        if not taken:
            taken.add(port)
        return port not in taken and bindable(port)

    monkeypatch.setattr(redis_server, "_bindable", first_one_taken)
    base = free_port(2)
    assert taken and taken.isdisjoint({base, base + 1})


def test_a_count_below_one_is_refused():
    with pytest.raises(ValueError, match="count"):
        free_port(0)


def test_ports_are_drawn_outside_the_kernels_ephemeral_range():
    # The kernel hands ephemeral ports to outgoing connections: a listening port
    # drawn from that range can be taken by a client before its server binds it.
    first, last = (
        int(p) for p in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    )
    for _ in range(50):
        base = free_port(4)
        assert not (first <= base + 3 and base <= last), (base, first, last)
