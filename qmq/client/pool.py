"""Connections by server address, for the blocking and the asyncio client.

One connection per address is enough: both connection classes pipeline any number of requests. A
connection that was lost (server restarted, connection closed after a fatal error) is replaced by a
new one the next time the address is used; the request that met the loss fails with ConnectionError
and the caller decides whether to try again.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Generic, TypeVar

from qmq.client.errors import ClientClosed, ConnectFailed
from qmq.client.routes import parse_address
from qmq.net.aio_client import AsyncConnection
from qmq.net.client import BlockingConnection
from qmq.net.common import CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S
from qmq.net.opening import TLSRefused

__all__ = ["AsyncConnectionPool", "ConnectFailed", "ConnectionPool"]

C = TypeVar("C", BlockingConnection, AsyncConnection)


def _connect_failed(address: str, exc: OSError) -> ConnectFailed:
    if isinstance(exc, TLSRefused):
        return ConnectFailed(address, str(exc), tls_refused=True)
    if isinstance(exc, TimeoutError):
        return ConnectFailed(address, "timed out")
    return ConnectFailed(address, exc.strerror or str(exc) or type(exc).__name__)


class _Pool(Generic[C]):
    """What both pools share: who the client says it is, how long to try to connect, and the tables."""

    def __init__(
        self, *, client_id: str | None = None, token: str | None = None, connect_timeout_s: float = CONNECT_TIMEOUT_S
    ) -> None:
        self.client_id = client_id
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()  # the blocking pool's guard of the tables (one thread uses an asyncio pool)
        self._address_locks: dict[str, Any] = {}  # one per address: opening one never waits for another
        self._connections: dict[str, C] = {}
        self._closed = False

    def _connect_timeout(self, call_timeout_s: float | None) -> float:
        """A connection opened for a call waits no longer than the call would for its reply (a
        meta server that hangs accepts the TCP connection but never the handshake: the next one
        is tried after the call's own wait, `qmq.client.routes.meta_call`)."""
        if call_timeout_s is None:
            return self.connect_timeout_s
        return min(self.connect_timeout_s, call_timeout_s)


class ConnectionPool(_Pool[BlockingConnection]):
    """Thread-safe. Opening a connection to one address never waits for another address."""

    def get(self, address: str, call_timeout_s: float | None = None) -> BlockingConnection:
        """The open connection to `address`, opened now if there is none (within `call_timeout_s`
        too, when given). Raises `ConnectFailed`, or RemoteError (the handshake was refused: a wrong
        token)."""
        with self._lock:
            if self._closed:
                raise ClientClosed()
            conn = self._connections.get(address)
            if conn is not None and not conn.closed:
                return conn
            address_lock = self._address_locks.setdefault(address, threading.Lock())
        with address_lock:
            with self._lock:
                conn = self._connections.get(address)
            if conn is not None and not conn.closed:
                return conn
            if conn is not None:
                conn.close()  # already lost: this only releases its socket and reader thread
            host, port = parse_address(address)
            try:
                conn = BlockingConnection.open(
                    host,
                    port,
                    client_id=self.client_id,
                    token=self.token,
                    timeout=self._connect_timeout(call_timeout_s),
                )
            except OSError as exc:
                raise _connect_failed(address, exc) from None
            with self._lock:
                if self._closed:
                    conn.close()
                    raise ClientClosed()
                self._connections[address] = conn
            return conn

    def request(
        self, address: str, code: int, body: dict[str, Any] | None, timeout: float = REQUEST_TIMEOUT_S
    ) -> dict[str, Any]:
        return self.get(address, timeout).request(code, body, timeout)

    def connected(self, address: str) -> BlockingConnection | None:
        """The open connection to `address`, or None (none is opened here)."""
        with self._lock:
            conn = self._connections.get(address)
        return conn if conn is not None and not conn.closed else None

    def close(self) -> None:
        """Close every connection; requests in flight fail with ConnectionError."""
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections.values()), {}
        for conn in connections:
            conn.close()


class AsyncConnectionPool(_Pool[AsyncConnection]):
    """The same for asyncio; used from one event loop."""

    async def get(self, address: str, call_timeout_s: float | None = None) -> AsyncConnection:
        if self._closed:
            raise ClientClosed()
        conn = self._connections.get(address)
        if conn is not None and not conn.closed:
            return conn
        async with self._address_locks.setdefault(address, asyncio.Lock()):
            conn = self._connections.get(address)
            if conn is not None and not conn.closed:
                return conn
            if conn is not None:
                await conn.close()
            host, port = parse_address(address)
            try:
                conn = await AsyncConnection.open(
                    host,
                    port,
                    client_id=self.client_id,
                    token=self.token,
                    timeout=self._connect_timeout(call_timeout_s),
                )
            except OSError as exc:
                raise _connect_failed(address, exc) from None
            if self._closed:
                await conn.close()
                raise ClientClosed()
            self._connections[address] = conn
            return conn

    async def request(
        self, address: str, code: int, body: dict[str, Any] | None, timeout: float = REQUEST_TIMEOUT_S
    ) -> dict[str, Any]:
        conn = await self.get(address, timeout)
        return await conn.request(code, body, timeout)

    async def close(self) -> None:
        self._closed = True
        connections, self._connections = list(self._connections.values()), {}
        for conn in connections:
            await conn.close()

    def connected(self, address: str) -> AsyncConnection | None:
        """The open connection to `address`, or None (none is opened here)."""
        if self._closed:
            return None
        conn = self._connections.get(address)
        return conn if conn is not None and not conn.closed else None
