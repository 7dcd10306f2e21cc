"""Whether something listens on a TCP port, asked from outside the process (`qmq dev`, the tests and
benchmarks waiting for the servers they start).

A plain connect is not proof: to a port of the ephemeral range on which nothing listens, the kernel
may pick that same port as the connecting socket's own and connect the socket to itself (TCP
simultaneous open). A probe that took that for a listener let a test talk to a meta server that was
still migrating its database (refused).
"""

from __future__ import annotations

import socket

PROBE_TIMEOUT_S = 0.2


def self_connected(sock: socket.socket) -> bool:
    """The connected `sock` is connected to itself, not to a listener."""
    return sock.getsockname() == sock.getpeername()


def accepts(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Something accepts connections on `host:port` right now."""
    with socket.socket() as s:
        s.settimeout(timeout_s)
        return s.connect_ex((host, port)) == 0 and not self_connected(s)
