"""The asyncio client: one TCP connection to a qmq server, with any number of requests in flight.

A reader task matches replies to waiting requests by request id. Promises: `request()` returns the
reply's body, or raises `RemoteError` (the server refused it), `TimeoutError` (no reply in time; a
late reply is dropped) or `ConnectionError` (the connection is gone: every request in flight fails
at once, and so does every later one). There is no reconnection here: open a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from qmq.net.common import (
    CONNECT_TIMEOUT_S,
    READ_CHUNK_BYTES,
    REQUEST_TIMEOUT_S,
    connection_refused,
    default_client_id,
    fresh_copy,
    resolve_token,
)
from qmq.protocol.connection import NEED_DATA, Connection, ErrorReply, Event, Response, Role
from qmq.protocol.errors import ProtocolError, RemoteError
from qmq.protocol.limits import DEFAULT_LIMITS, Limits


class AsyncConnection:
    """Open with `await AsyncConnection.open(...)`; usable as `async with`."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection, address: str
    ) -> None:
        """Use `open()`; this only wires the parts together."""
        self.address = address
        self.server_info: dict[str, Any] = {}  # the handshake reply: version, max_frame_bytes
        self._reader = reader
        self._writer = writer
        self._conn = conn
        self._pending: dict[int, asyncio.Future[dict[str, Any] | None]] = {}
        self._closed: ConnectionError | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._out: list[bytes] = []  # frames waiting for the end of this loop iteration

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        client_id: str | None = None,
        token: str | None = None,
        timeout: float = CONNECT_TIMEOUT_S,
        limits: Limits = DEFAULT_LIMITS,
    ) -> AsyncConnection:
        """Connect and handshake. `token` defaults to `$QMQ_TOKEN`. Raises `RemoteError` when the
        server refuses the handshake (UNAUTHORIZED, UNSUPPORTED_VERSION, ...), `TimeoutError`, or
        `OSError` when nothing listens."""
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
        conn = Connection(
            Role.CLIENT, limits=limits, token=resolve_token(token), client_id=client_id or default_client_id()
        )
        self = cls(reader, writer, conn, f"{host}:{port}")
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"qmq-reader-{self.address}")
        try:
            request_id, data = conn.start_handshake()
            self.server_info = await self._exchange(request_id, data, timeout) or {}
        except BaseException:
            await self.close()
            raise
        return self

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def request(
        self, code: int, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> dict[str, Any]:
        """Send a request and return the reply's body ({} for an empty one)."""
        self._check_open()
        request_id, data = self._conn.send_request(code, body)
        return await self._exchange(request_id, data, timeout) or {}

    async def send_oneway(self, code: int, body: dict[str, Any] | None = None) -> None:
        """Send a request that gets no reply, not even an error."""
        self._check_open()
        _, data = self._conn.send_request(code, body, oneway=True)
        self._write(data)
        await self._writer.drain()

    async def close(self) -> None:
        """Close the connection; requests in flight fail with ConnectionError."""
        if self._closed is None:
            self._closed = ConnectionError(f"connection to {self.address} was closed by this client")
        self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self._fail_pending(self._closed)
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> AsyncConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _exchange(self, request_id: int, data: bytes, timeout: float) -> dict[str, Any] | None:
        future: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self._write(data)
            async with asyncio.timeout(timeout):
                await self._writer.drain()
                return await future
        except TimeoutError:
            raise TimeoutError(f"no reply from {self.address} within {timeout:g} s") from None
        finally:
            if self._pending.pop(request_id, None) is not None:  # timed out or cancelled: nobody waits
                self._conn.abandon(request_id)

    def _write(self, data: bytes) -> None:
        """Queue a frame; frames queued in one loop iteration go out in one write (pipelined requests
        made together cost one system call)."""
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        if self._out and not self._writer.is_closing():
            self._writer.write(b"".join(self._out) if len(self._out) > 1 else self._out[0])
        self._out.clear()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise ConnectionError(str(self._closed))

    async def _read_loop(self) -> None:
        error = ConnectionError(f"connection to {self.address} was closed by this client")
        try:
            while True:
                data = await self._reader.read(READ_CHUNK_BYTES)
                if not data:
                    error = ConnectionError(f"connection to {self.address} was closed by the server")
                    return
                self._conn.receive_data(data)
                while (event := self._conn.next_event()) is not NEED_DATA:
                    self._dispatch(event)
        except ProtocolError as exc:
            error = ConnectionError(f"{self.address} broke the protocol: {exc}")
        except OSError as exc:
            error = ConnectionError(f"connection to {self.address} was lost: {exc}")
        finally:
            if self._closed is None:
                self._closed = error
            self._fail_pending(self._closed)
            self._writer.close()

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, ErrorReply) and event.concerns_connection:
            remote, self._closed = connection_refused(self.address, event)
            self._fail_pending(remote)
            return
        future = self._pending.pop(event.request_id, None)
        if future is None or future.done():
            return
        if isinstance(event, Response):
            future.set_result(event.body)
        elif isinstance(event, ErrorReply):
            future.set_exception(RemoteError(event.code, event.message))

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(fresh_copy(error))
