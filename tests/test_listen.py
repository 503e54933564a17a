"""Every interface, in the pod's family: 0.0.0.0 is IPv4 alone, and a pod of an IPv6
cluster has no IPv4 address (its probes and traffic were refused)."""

from __future__ import annotations

from tandem.listen import every_interface, every_interface_url


def test_every_interface_is_ipv6_in_a_pod_whose_address_is():
    assert every_interface("0.0.0.0", "fd00::7") == "::"
    assert every_interface("0.0.0.0", "10.0.0.7") == "0.0.0.0"
    assert every_interface("0.0.0.0", "") == "0.0.0.0"  # not in a pod
    assert every_interface("127.0.0.1", "fd00::7") == "127.0.0.1"  # asked for: kept


def test_the_operators_liveness_url_follows_the_pods_family(monkeypatch):
    url = "http://0.0.0.0:8080/healthz"
    assert every_interface_url(url, "fd00::7") == "http://[::]:8080/healthz"
    assert every_interface_url(url, "10.0.0.7") == url
    monkeypatch.setenv("POD_IP", "fd00::8")
    assert every_interface_url(url) == "http://[::]:8080/healthz"
    assert every_interface_url("http://127.0.0.1:8080/healthz") == "http://127.0.0.1:8080/healthz"
