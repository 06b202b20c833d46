"""Ports for the servers a test starts (agents, fake agents, vLLM, Prometheus, webhooks).

A port found free by binding port 0 comes from the kernel's ephemeral range, the range every
outgoing connection of every process on the machine also draws its local port from: between
the test closing its probe socket and the server binding the port, a client socket (a vLLM
engine's, an HTTP client's) could take it, and the server died with "address already in use"
(an agent in CI). So ports are handed out *below* the ephemeral range, where no outgoing
connection is ever given a port, each at most once per test process, and each checked free by
a bind first (a server of an earlier test may still hold one).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port"]

#: Lowest port handed out (above the well-known and most registered service ports).
FLOOR = 20000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _band() -> range:
    """The ports below the kernel's ephemeral range (Linux's default: 32768-60999)."""
    try:
        low = int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(FLOOR, max(low, FLOOR + 1000))


def _candidates() -> Iterator[int]:
    band = _band()
    # A start that differs between test processes, so two runs side by side rarely probe the
    # same ports first; within a process the cycle never hands out a port twice.
    start = random.Random(os.getpid()).randrange(len(band))
    ordered = [*band[start:], *band[:start]]
    return iter(ordered)


_NEXT = _candidates()


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port on 127.0.0.1 no other server holds, outside the ephemeral range, not handed out
    before by this process."""
    for port in _NEXT:
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port left in {_band()}")
