"""The asyncio client: one TCP connection to a qmq server, with any number of requests in flight.

A reader task matches replies to waiting requests by request id. Promises: `request()` returns the
reply's body, or raises `RemoteError` (the server refused it), `TimeoutError` (no reply in time; a
late reply is dropped) or `ConnectionError` (the connection is gone: every request in flight fails
at once, and so does every later one). There is no reconnection here: open a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Coroutine
from typing import Any

from qmq.net.coalesce import FrameQueue
from qmq.net.common import (
    READ_CHUNK_BYTES,
    REQUEST_TIMEOUT_S,
    ClientSide,
    fresh_copy,
    settle,
)
from qmq.net.opening import Opener, tls_failed
from qmq.net.tls import closed_before_handshake_hint
from qmq.protocol.errors import ProtocolError

_Reply = asyncio.Future[dict[str, Any] | None]


class AsyncConnection(Opener[Coroutine[Any, Any, "AsyncConnection"]]):
    """Open with `await AsyncConnection.open(...)` (qmq/net/opening.py); usable as `async with`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, side: ClientSide[_Reply]) -> None:
        """Use `open()`; this only wires the parts together."""
        self.address = side.address
        self.server_info: dict[str, Any] = {}  # the handshake reply: version, max_frame_bytes
        self._reader = reader
        self._writer = writer
        self._side = side
        self._reader_task: asyncio.Task[None] | None = None
        self._out = FrameQueue(writer.write, writer.is_closing)
        self._tls = False

    @classmethod
    async def _connect(
        cls, host: str, port: int, side: ClientSide[_Reply], tls: ssl.SSLContext | None, timeout: float
    ) -> AsyncConnection:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port, ssl=tls)
        except ssl.SSLError as exc:
            raise tls_failed(side.address, exc) from None
        self = cls(reader, writer, side)
        self._tls = tls is not None
        self._reader_task = asyncio.create_task(self._read_loop(), name=f"qmq-reader-{self.address}")
        try:
            future: _Reply = asyncio.get_running_loop().create_future()
            request_id, data = self._side.handshake(future)
            self.server_info = await self._exchange(request_id, data, future, timeout) or {}
        except BaseException:
            await self.close()
            raise
        return self

    @property
    def closed(self) -> bool:
        return self._side.error is not None

    async def request(
        self, code: int, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> dict[str, Any]:
        """Send a request and return the reply's body ({} for an empty one)."""
        future: _Reply = asyncio.get_running_loop().create_future()
        request_id, data = self._side.request(code, body, future)
        return await self._exchange(request_id, data, future, timeout) or {}

    def start(self, code: int, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S) -> _Reply:
        """Send a request now and return the future of its reply's body (None for an empty one), with
        the outcomes of `request`. Unlike a task running `request`, the frame is written before this
        returns: a caller that goes on computing without awaiting (a consumer's pull put in flight
        ahead, qmq/client/consuming.py) has the server working meanwhile. Raises ConnectionError
        when the connection is gone."""
        loop = asyncio.get_running_loop()
        future: _Reply = loop.create_future()
        request_id, data = self._side.request(code, body, future)
        self._out.put(data)
        self._out.flush()  # with any frame queued before it, in order

        def expire() -> None:
            if self._side.abandon(request_id):
                settle(future, TimeoutError(f"no reply from {self.address} within {timeout:g} s"))

        timer = loop.call_later(timeout, expire)
        future.add_done_callback(lambda _: (timer.cancel(), self._side.abandon(request_id)))
        return future

    async def send_oneway(self, code: int, body: dict[str, Any] | None = None) -> None:
        """Send a request that gets no reply, not even an error."""
        _, data = self._side.request(code, body, None)
        self._out.put(data)
        await self._writer.drain()

    async def close(self) -> None:
        """Close the connection; requests in flight fail with ConnectionError."""
        self._lose(ConnectionError(f"connection to {self.address} was closed by this client"))
        self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> AsyncConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _exchange(self, request_id: int, data: bytes, future: _Reply, timeout: float) -> dict[str, Any] | None:
        try:
            self._out.put(data)
            async with asyncio.timeout(timeout):
                await self._writer.drain()
                return await future
        except TimeoutError:
            raise TimeoutError(f"no reply from {self.address} within {timeout:g} s") from None
        finally:
            self._side.abandon(request_id)  # timed out or cancelled: nobody waits (else a no-op)

    async def _read_loop(self) -> None:
        error = ConnectionError(f"connection to {self.address} was closed by this client")
        try:
            while True:
                data = await self._reader.read(READ_CHUNK_BYTES)
                if not data:
                    hint = "" if self._side.protocol.handshake_done else closed_before_handshake_hint(self._tls)
                    error = ConnectionError(f"connection to {self.address} was closed by the server{hint}")
                    return
                for waiter, outcome in self._side.receive(data):
                    settle(waiter, outcome)
                if self._side.error is not None:  # the server refused the whole connection, and closes it next
                    return
        except ProtocolError as exc:
            error = ConnectionError(f"{self.address} broke the protocol: {exc}")
        except OSError as exc:
            error = ConnectionError(f"connection to {self.address} was lost: {exc}")
        finally:
            self._lose(error)
            self._writer.close()

    def _lose(self, error: ConnectionError) -> None:
        """Mark the connection dead (keeping the first reason) and fail every waiter with the reason."""
        for waiter in self._side.lose(error):
            settle(waiter, fresh_copy(self._side.error or error))
