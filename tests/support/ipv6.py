"""Whether this host can listen on IPv6's loopback (some containers have IPv4 only)."""

from __future__ import annotations

import socket


def ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True
