"""The port probe of `qmq dev`, the tests and the benchmarks (qmq/net/probe.py): a socket the kernel
connected to itself is no listener."""

from __future__ import annotations

import socket

from qmq.net.probe import accepts, self_connected
from tests.support.processes import free_port

HOST = "127.0.0.1"


def test_a_socket_connected_to_itself_is_not_a_listener() -> None:
    # what a probe's connect can meet by chance on a port of the ephemeral range: here on purpose
    port = free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, port))
        s.connect((HOST, port))  # TCP simultaneous open with itself: no error
        assert self_connected(s)
    assert not accepts(HOST, port)


def test_a_listener_accepts_and_a_free_port_does_not() -> None:
    with socket.socket() as listener:
        listener.bind((HOST, 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert accepts(HOST, port)
        with socket.create_connection((HOST, port)) as client:
            assert not self_connected(client)
    assert not accepts(HOST, port)
