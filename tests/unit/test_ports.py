"""The test servers' ports (tests/harness/ports.py) never come from the ephemeral range."""

from __future__ import annotations

import socket

from tests.harness.ports import _band, _bindable, free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_free() -> None:
    band = _band()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(port in band for port in ports)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ephemeral:
        low = int(ephemeral.read().split()[0])
    assert max(ports) < low
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free: nothing was left bound


def test_a_port_a_server_holds_is_not_free() -> None:
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        assert not _bindable(port)
    assert _bindable(port)
