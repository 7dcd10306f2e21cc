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
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from qmq.memory import collect_less, keep_large_buffers
from qmq.net.acl import Principal
from qmq.net.auth import CHECK_CACHE_S, Authenticator
from qmq.net.coalesce import FrameQueue
from qmq.net.common import READ_CHUNK_BYTES
from qmq.net.guard import ConnectionCaps, MemoryBudget, NetLimits
from qmq.net.options import server_options
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
    principal: Principal | None = None  # a per-application credential's rights; None: the shared token
    checked_at: float = 0.0  # when the credential was last checked (loop time)

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
        net_limits: NetLimits | None = None,
        tls: ssl.SSLContext | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        """`token`: the token every client must present; None lets anyone in. Port 0 picks a free
        port, see `port` after `start()`. A connection without a handshake after
        `handshake_timeout_s` gets a HANDSHAKE_REQUIRED error frame and is closed. `net_limits`
        (connections, memory, timeouts) and `tls` (a server-side SSL context) default to the
        process's `qmq.net.options.server_options()`, and so does `authenticator`, which lets clients
        with a per-application credential in (only when a `token` is set; docs/security.md)."""
        options = server_options()
        self.handler = handler
        self.host = host
        self.limits = limits
        self.token = token
        self.handshake_timeout_s = handshake_timeout_s
        self.net_limits = net_limits or options.net_limits
        self.tls = tls if tls is not None else options.tls
        self.authenticator = authenticator or options.authenticator
        self.budget = MemoryBudget(self.net_limits.memory_budget_bytes)
        self.caps = ConnectionCaps(self.net_limits)
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
        tls_options = {"ssl": self.tls, "ssl_handshake_timeout": self.handshake_timeout_s} if self.tls else {}
        self._server = await asyncio.start_server(self._accept, self.host, self._port, **tls_options)
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("listening on %s:%d%s", self.host, self.port, " (TLS)" if self.tls else "")

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
        connection = _ServerConnection(self, reader, writer)
        refusal = self.caps.admit(connection.peer.host)
        run = connection.run() if refusal is None else connection.refuse(refusal)
        task = asyncio.get_running_loop().create_task(run)
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)


async def serve(handler: Handler, host: str = "127.0.0.1", port: int = 0, **options: Any) -> Server:
    """Start a `Server` listening on host:port (`options` as `Server` takes them) and return it;
    `await server.close()` to stop."""
    server = Server(handler, host=host, port=port, **options)
    await server.start()
    return server


class _ServerConnection:
    """One accepted connection: a read loop that turns bytes into requests, and a task per request.

    Memory: what the connection holds (input not yet turned into requests, plus the frames of the
    requests not yet answered) is charged to the server's `MemoryBudget`; the connection stops
    reading (TCP pushes back) while it holds `max_connection_bytes` or has
    MAX_IN_FLIGHT_PER_CONNECTION requests in flight, and waits while the whole server is over its
    budget."""

    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.limits = server.net_limits
        self.reader = reader
        self.writer = writer
        peername = writer.get_extra_info("peername") or ("?", 0)
        self.peer = PeerInfo(host=str(peername[0]), port=int(peername[1]))
        self.conn = Connection(
            Role.SERVER, limits=server.limits, token=server.token, accept_credentials=server.authenticator is not None
        )
        self.credential: str | None = None
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT_PER_CONNECTION)
        self.tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.request_bytes = 0  # frames of the requests in flight
        self.held_bytes = 0  # what is charged to the server's budget for this connection
        self.room = asyncio.Event()  # set when a request in flight is answered
        self.output_closed = False  # after write_eof() nothing more may be written
        self.out = FrameQueue(writer.write, lambda: self.output_closed or writer.is_closing())
        with contextlib.suppress(AttributeError, NotImplementedError):
            writer.transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)

    async def refuse(self, reason: str) -> None:
        """A connection over a cap: tell the client why (an UNAVAILABLE error frame about the whole
        connection, which its handshake raises as RemoteError) and close."""
        _note_refusal(self.server, self.peer, reason)
        try:
            await self._close_with_error(ProtocolError(ErrorCode.UNAVAILABLE, f"connection refused: {reason}"))
        except OSError:
            pass
        finally:
            self.writer.close()

    async def run(self) -> None:
        reason = "closed by the peer"
        try:
            await self._read_loop()
        except _Idle as exc:
            reason = str(exc)
            await self._close_with_error(ProtocolError(ErrorCode.TIMEOUT, reason))
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
            self.out.put(self.conn.send_error(CONNECTION_REQUEST_ID, ErrorCode.UNAVAILABLE, "server is shutting down"))
            raise
        finally:
            # Let the handlers still running finish: they may be half-way through work worth finishing;
            # their replies go nowhere if the peer is gone.
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self.out.flush()
            self.writer.close()
            self.server.budget.release(self.held_bytes)
            self.held_bytes = 0
            self.server.caps.leave(self.peer.host)
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            log.info("connection %s closed: %s, %d requests", self.peer, reason, self.requests)

    async def _read_loop(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.server.handshake_timeout_s
        while True:
            await self._wait_for_room()
            data = await self._read(deadline)
            if not data:
                return
            self.conn.receive_data(data)
            self._account()
            buffered = self.conn.buffered_bytes
            while (event := self.conn.next_event()) is not NEED_DATA:
                size, buffered = buffered - self.conn.buffered_bytes, self.conn.buffered_bytes
                if isinstance(event, HandshakeAccepted):
                    self.peer.client_id = event.client_id
                    if event.credential is not None:
                        self.credential = event.credential
                        await self._authenticate()
                    log.info("connection %s open", self.peer)
                    self.out.put(event.reply)
                elif isinstance(event, Request):
                    if self.credential is not None and self._stale_credential():
                        await self._authenticate()
                    await self.slots.acquire()  # backpressure: stop reading while the connection is full
                    self.requests += 1
                    self.request_bytes += size
                    task = asyncio.create_task(self._handle(event, size))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
            self._account()

    def _stale_credential(self) -> bool:
        return asyncio.get_running_loop().time() - self.peer.checked_at > CHECK_CACHE_S

    async def _authenticate(self) -> None:
        """Check the connection's credential (at the handshake, then every CHECK_CACHE_S): a fatal
        UNAUTHORIZED when it stands for nothing (any more), UNAVAILABLE when it cannot be checked."""
        assert self.server.authenticator is not None and self.credential is not None
        try:
            principal = await self.server.authenticator.authenticate(self.credential)
        except Exception as exc:
            raise ProtocolError(ErrorCode.UNAVAILABLE, f"cannot check the credential now: {exc}") from None
        if principal is None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "the token is wrong (unknown or revoked credential)")
        if self.peer.principal is None:
            log.info("connection %s: credential %s of application %s", self.peer, principal.id, principal.app)
        self.peer.principal = principal
        self.peer.checked_at = asyncio.get_running_loop().time()

    async def _read(self, handshake_deadline: float) -> bytes:
        """The next chunk of input (b"" at the end), within the handshake deadline until the
        handshake is done; raises `_Idle` when nothing comes for the idle timeout while no request
        is in flight (a long poll in flight keeps a connection alive)."""
        if not self.conn.handshake_done:
            try:
                async with asyncio.timeout_at(handshake_deadline):
                    return await self.reader.read(READ_CHUNK_BYTES)
            except TimeoutError:
                timeout_s = self.server.handshake_timeout_s
                raise ProtocolError(ErrorCode.HANDSHAKE_REQUIRED, f"no handshake within {timeout_s:g} s") from None
        idle_s = self.limits.idle_timeout_s
        if idle_s is None:
            return await self.reader.read(READ_CHUNK_BYTES)
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    return await self.reader.read(READ_CHUNK_BYTES)
            except TimeoutError:
                if not self.tasks:
                    raise _Idle(f"idle for {idle_s:g} s (--idle-timeout)") from None

    async def _wait_for_room(self) -> None:
        """Wait while this connection holds its limit of bytes, then while the server is over its
        memory budget (refusing the connection with UNAVAILABLE if that lasts `memory_wait_s`)."""
        while self.request_bytes >= self.limits.max_connection_bytes:
            self.room.clear()
            await self.room.wait()
        budget = self.server.budget
        if budget.exhausted:
            try:
                await budget.wait(self.limits.memory_wait_s)
            except TimeoutError:
                raise ProtocolError(
                    ErrorCode.UNAVAILABLE,
                    f"the server's memory budget ({budget.limit_bytes // 2**20} MiB, --memory-budget) stayed "
                    f"exhausted for {self.limits.memory_wait_s:g} s; try again later",
                ) from None

    def _account(self) -> None:
        """Bring this connection's charge on the server's budget up to date."""
        held = self.conn.buffered_bytes + self.request_bytes
        if held > self.held_bytes:
            self.server.budget.charge(held - self.held_bytes)
        elif held < self.held_bytes:
            self.server.budget.release(self.held_bytes - held)
        self.held_bytes = held

    async def _handle(self, request: Request, size: int) -> None:
        close_after = False
        try:
            try:
                if request.error is not None:
                    raise request.error
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
            self.out.put(reply)
            if close_after:
                log.warning("connection %s: fatal error on request code %d, closing", self.peer, request.code)
                self.out.flush()
                self.writer.close()
            await self._drain()
        finally:
            self.request_bytes -= size
            self._account()
            self.room.set()
            self.slots.release()

    async def _drain(self) -> None:
        """Wait while the replies queued for the peer exceed the write buffer limit; a peer that
        leaves them unread for `slow_read_timeout_s` is cut off (its connection aborted), so it
        cannot make the server hold its replies for ever."""
        timeout_s = self.limits.slow_read_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                await self.writer.drain()
        except TimeoutError:  # (before OSError, of which it is a subclass)
            queued = self.writer.transport.get_write_buffer_size()
            log.warning(
                "connection %s: %d bytes of replies left unread for %g s (--slow-read-timeout), cutting it off",
                self.peer,
                queued,
                timeout_s,
            )
            self.writer.transport.abort()
        except OSError:
            pass  # the peer is gone: its read loop ends the connection

    async def _close_with_error(self, exc: ProtocolError) -> None:
        """Send the error frame, then read and drop the peer's input for a moment before closing:
        closing with unread input makes the kernel send RST, which can destroy the error frame in
        the peer's receive buffer before the peer reads it."""
        self.out.put(self.conn.send_error(CONNECTION_REQUEST_ID, exc.code, exc.message))
        self.out.flush()
        with contextlib.suppress(OSError, TimeoutError):
            if self.writer.can_write_eof():
                self.output_closed = True
                self.writer.write_eof()
            async with asyncio.timeout(CLOSE_LINGER_S):
                while await self.reader.read(READ_CHUNK_BYTES):
                    pass


class _Idle(Exception):
    """A connection stayed idle past the idle timeout."""


REFUSAL_LOG_INTERVAL_S = 10.0  # refused connections are logged at most once per interval per server
_last_refusal_log: dict[int, float] = {}


def _note_refusal(server: Server, peer: PeerInfo, reason: str) -> None:
    """Log a refused connection, at most once per REFUSAL_LOG_INTERVAL_S per server: a flood of
    connections must not become a flood of log lines."""
    now = asyncio.get_running_loop().time()
    if now - _last_refusal_log.get(id(server), -REFUSAL_LOG_INTERVAL_S) >= REFUSAL_LOG_INTERVAL_S:
        _last_refusal_log[id(server)] = now
        log.warning("refusing connections (for instance %s): %s", peer, reason)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: how a server process learns to shut down cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run_process(main: Coroutine[Any, Any, None]) -> None:
    """Run a server process's main coroutine to the end, on uvloop when it is installed, with its
    large buffers kept for reuse and its garbage collected less often (qmq/memory.py)."""
    keep_large_buffers()
    collect_less()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)
