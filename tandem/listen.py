"""The address a server listens on for "every interface": every one of the pod's family.

0.0.0.0 is every IPv4 interface only: on an IPv6-only cluster a pod has no IPv4 address,
and its probes and its Service's traffic were refused (the gateway never became ready,
the operator failed its liveness probe). Where the pod's own address (POD_IP, from the
downward API) is IPv6, every interface is "::" instead. An explicit address is kept.
"""

from __future__ import annotations

import os

EVERY_IPV4 = "0.0.0.0"
EVERY_IPV6 = "::"


def every_interface(host: str, pod_ip: str | None = None) -> str:
    """`host`, or "::" for 0.0.0.0 in a pod whose address (`pod_ip`, else $POD_IP) is IPv6."""
    pod_ip = os.environ.get("POD_IP", "") if pod_ip is None else pod_ip
    return EVERY_IPV6 if host == EVERY_IPV4 and ":" in pod_ip else host


def every_interface_url(url: str, pod_ip: str | None = None) -> str:
    """A URL to serve at (the operator's liveness endpoint), its 0.0.0.0 host made
    every_interface's."""
    host = every_interface(EVERY_IPV4, pod_ip)
    return url.replace(f"//{EVERY_IPV4}:", f"//[{host}]:", 1) if host != EVERY_IPV4 else url


def local_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on `host`: the loopback
    address for a wildcard (http://0.0.0.0:8000 is no address to give a user)."""
    return {EVERY_IPV4: "127.0.0.1", EVERY_IPV6: "::1", "": "127.0.0.1"}.get(host, host)
