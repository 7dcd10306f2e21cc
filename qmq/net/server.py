"""The asyncio server helper every qmq server is built on: it speaks the wire protocol and calls one
handler per request (for the shipped servers, `Service.handle` of `qmq/net/service.py`).

Promises: requests on one connection are handled concurrently (replies may go out of order), at most
MAX_IN_FLIGHT_PER_CONNECTION at a time per connection (beyond that the connection is not read, so TCP
pushes back on the client); a handler's error is answered with an error frame for that request only;
a peer that breaks the protocol gets an error frame and its connection closed, and nobody else
notices. Logs go to the "qmq.net" logger, one line per connection opened, closed or broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from qmq.net.common import READ_CHUNK_BYTES
from qmq.protocol.connection import (
    CONNECTION_REQUEST_ID,
    NEED_DATA,
    Connection,
    HandshakeAccepted,
    Request,
    Role,
)
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger("qmq.net")

MAX_IN_FLIGHT_PER_CONNECTION = 1024  # requests being handled at once on one connection
HANDSHAKE_TIMEOUT_S = 10.0  # a connection must complete its handshake within this
CLOSE_LINGER_S = 2.0  # after a fatal error frame, how long to drain the peer's input before closing


@dataclass
class PeerInfo:
    """Who sent a request: the peer's address and the client id from its handshake."""

    host: str
    port: int
    client_id: str = ""

    def __str__(self) -> str:
        return f"{self.client_id or '?'}@{self.host}:{self.port}"


Handler = Callable[[Request, PeerInfo], Awaitable[dict[str, Any] | None]]
"""`async def handler(request, peer) -> dict | None`: the return value is the reply's body. Raise
`ProtocolError` (for instance UNKNOWN_REQUEST or BAD_REQUEST, fatal=False) or `RemoteError` to
answer with an error frame; a fatal `ProtocolError` also closes the connection. Any other exception
is logged and answered with an INTERNAL error frame."""


class Server:
    """A listening qmq server. `await start()`, then `await close()` (or `async with`)."""

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        """`token`: the token every client must present; None lets anyone in. Port 0 picks a free
        port, see `port` after `start()`. A connection without a handshake after
        `handshake_timeout_s` gets a HANDSHAKE_REQUIRED error frame and is closed."""
        self.handler = handler
        self.host = host
        self.limits = limits
        self.token = token
        self.handshake_timeout_s = handshake_timeout_s
        self._port = port
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port listened on (the real one when 0 was asked for)."""
        return self._port

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self._port)
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("listening on %s:%d", self.host, self.port)

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    async def close(self) -> None:
        """Stop listening, tell every client the server is going away (an UNAVAILABLE error frame
        with request id 0), cancel the handlers still running and close every connection."""
        if self._server is None:
            return
        self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        log.info("closed %s:%d", self.host, self.port)

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(_ServerConnection(self, reader, writer).run())
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)


async def serve(
    handler: Handler,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    token: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> Server:
    """Start a `Server` listening on host:port and return it; `await server.close()` to stop."""
    server = Server(handler, host=host, port=port, token=token, limits=limits, handshake_timeout_s=handshake_timeout_s)
    await server.start()
    return server


class _ServerConnection:
    """One accepted connection: a read loop that turns bytes into requests, and a task per request."""

    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        peername = writer.get_extra_info("peername") or ("?", 0)
        self.peer = PeerInfo(host=str(peername[0]), port=int(peername[1]))
        self.conn = Connection(Role.SERVER, limits=server.limits, token=server.token)
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT_PER_CONNECTION)
        self.tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.output_closed = False  # after write_eof() nothing more may be written
        self.out: list[bytes] = []  # replies waiting for the end of this loop iteration

    async def run(self) -> None:
        reason = "closed by the peer"
        try:
            await self._read_loop()
        except ProtocolError as exc:
            reason = f"protocol error {exc.code.name}"
            log.warning("connection %s: %s, closing", self.peer, exc)
            await self._close_with_error(exc)
        except OSError as exc:
            reason = f"lost ({exc})"
        except asyncio.CancelledError:
            reason = "server shutting down"
            for task in self.tasks:
                task.cancel()
            self._write(self.conn.send_error(CONNECTION_REQUEST_ID, ErrorCode.UNAVAILABLE, "server is shutting down"))
            raise
        finally:
            # Let the handlers still running finish: they may be half-way through work worth finishing;
            # their replies go nowhere if the peer is gone.
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self._flush()
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            log.info("connection %s closed: %s, %d requests", self.peer, reason, self.requests)

    async def _read_loop(self) -> None:
        timeout_s = self.server.handshake_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self.conn.handshake_done:
                data = await self.reader.read(READ_CHUNK_BYTES)
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await self.reader.read(READ_CHUNK_BYTES)
                except TimeoutError:
                    raise ProtocolError(ErrorCode.HANDSHAKE_REQUIRED, f"no handshake within {timeout_s:g} s") from None
            if not data:
                return
            self.conn.receive_data(data)
            while (event := self.conn.next_event()) is not NEED_DATA:
                if isinstance(event, HandshakeAccepted):
                    self.peer.client_id = event.client_id
                    log.info("connection %s open", self.peer)
                    self._write(event.reply)
                elif isinstance(event, Request):
                    await self.slots.acquire()  # backpressure: stop reading while the connection is full
                    self.requests += 1
                    task = asyncio.create_task(self._handle(event))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)

    async def _handle(self, request: Request) -> None:
        close_after = False
        try:
            try:
                body = await self.server.handler(request, self.peer)
                if body is not None and not isinstance(body, dict):
                    raise TypeError(f"handler returned {type(body).__name__}, not a dict or None")
                reply = self.conn.send_response(request.request_id, request.code, body)
            except ProtocolError as exc:
                reply = self.conn.send_error(request.request_id, exc.code, exc.message)
                close_after = exc.fatal
            except RemoteError as exc:
                reply = self.conn.send_error(request.request_id, exc.code, exc.message)
            except Exception as exc:
                log.exception("connection %s: request code %d failed", self.peer, request.code)
                reply = self.conn.send_error(request.request_id, ErrorCode.INTERNAL, repr(exc))
            if request.oneway:
                return
            self._write(reply)
            if close_after:
                log.warning("connection %s: fatal error on request code %d, closing", self.peer, request.code)
                self._flush()
                self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.drain()
        finally:
            self.slots.release()

    def _write(self, data: bytes) -> None:
        """Queue `data`; what is queued goes out in one write at the end of this loop iteration, so
        pipelined replies finished together cost one system call, not one each."""
        if not self.out:
            asyncio.get_running_loop().call_soon(self._flush)
        self.out.append(data)

    def _flush(self) -> None:
        if self.out and not (self.output_closed or self.writer.is_closing()):
            self.writer.write(b"".join(self.out) if len(self.out) > 1 else self.out[0])
        self.out.clear()

    async def _close_with_error(self, exc: ProtocolError) -> None:
        """Send the error frame, then read and drop the peer's input for a moment before closing:
        closing with unread input makes the kernel send RST, which can destroy the error frame in
        the peer's receive buffer before the peer reads it."""
        self._write(self.conn.send_error(CONNECTION_REQUEST_ID, exc.code, exc.message))
        self._flush()
        with contextlib.suppress(OSError, TimeoutError):
            if self.writer.can_write_eof():
                self.output_closed = True
                self.writer.write_eof()
            async with asyncio.timeout(CLOSE_LINGER_S):
                while await self.reader.read(READ_CHUNK_BYTES):
                    pass


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: how a server process learns to shut down cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_process(main: Coroutine[Any, Any, None]) -> None:
    """Run a server process's main coroutine to the end, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
