"""How either client (qmq/net/client.py, qmq/net/aio_client.py) opens a connection: the options of
`open()`, their defaults and the error of a failed TLS handshake, once. Each client does only its own
I/O, in `_connect`, with the client side and TLS settled here."""

from __future__ import annotations

import ssl
from typing import Generic, TypeVar

from qmq.net.common import CONNECT_TIMEOUT_S, ClientSide
from qmq.net.tls import client_context
from qmq.protocol.limits import DEFAULT_LIMITS, Limits

R = TypeVar("R")  # what `open()` returns: the connection, or (asyncio) a coroutine of it


class Opener(Generic[R]):
    """The `open()` both clients share."""

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        *,
        client_id: str | None = None,
        token: str | None = None,
        timeout: float = CONNECT_TIMEOUT_S,
        limits: Limits = DEFAULT_LIMITS,
        tls: ssl.SSLContext | None = None,
    ) -> R:
        """Connect and handshake. `token` defaults to `$QMQ_TOKEN`, `tls` to the process's client
        TLS settings (`qmq.net.tls.client_context()`: none means plain TCP). Raises `RemoteError`
        when the server refuses the handshake (UNAUTHORIZED, UNSUPPORTED_VERSION, ...),
        `TimeoutError`, `ConnectionError` when the TLS handshake fails, or `OSError` when nothing
        listens."""
        side = ClientSide(f"{host}:{port}", client_id=client_id, token=token, limits=limits)
        return cls._connect(host, port, side, client_context() if tls is None else tls, timeout)

    @classmethod
    def _connect(cls, host: str, port: int, side: ClientSide, tls: ssl.SSLContext | None, timeout: float) -> R:
        """Open the socket (TLS if `tls`), wire the connection to `side` and handshake in `timeout`."""
        raise NotImplementedError


class TLSRefused(ConnectionError):
    """A TLS handshake failed: a certificate not trusted, a protocol refused, TLS against a plain
    server. A setting to fix, not a moment to wait out: trying again soon gets the same answer."""


def tls_failed(address: str, exc: ssl.SSLError) -> TLSRefused:
    """The error of a TLS handshake that failed."""
    return TLSRefused(f"TLS with {address} failed: {exc.reason or exc}")
