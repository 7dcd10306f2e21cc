"""What the asyncio and the blocking client connection share: settings, and `ClientSide`.

`ClientSide` is one client connection without I/O: the protocol state machine
(`qmq.protocol.connection.Connection`) plus who waits for which request id. Both connection classes
drive it: they write the bytes it returns, feed it the bytes they read, and settle the waiters it
hands back (a concurrent Future in the blocking connection, an asyncio Future in the other), so the
handshake, the matching of replies and the handling of an error frame about the whole connection
are written once.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Generic, TypeVar

from qmq.protocol.connection import NEED_DATA, Connection, ErrorReply, Response, Role
from qmq.protocol.errors import RemoteError
from qmq.protocol.limits import DEFAULT_LIMITS, Limits

TOKEN_ENV = "QMQ_TOKEN"
CONNECT_TIMEOUT_S = 10.0  # TCP connect plus handshake
REQUEST_TIMEOUT_S = 30.0  # default wait for one reply
READ_CHUNK_BYTES = 256 * 1024  # at most this much is read from a socket at once

W = TypeVar("W")  # a waiter: anything with done(), set_result() and set_exception()
Outcome = dict[str, Any] | None | BaseException  # a reply's body, or the error a waiter gets


def default_client_id() -> str:
    """How a client names itself in server logs when not told: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def resolve_token(token: str | None) -> str | None:
    """The explicit token, else `$QMQ_TOKEN`; an empty string means no token."""
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    return token or None


def fresh_copy(error: BaseException) -> BaseException:
    """A new exception like `error`, so each waiter raises its own object (tracebacks are per object)."""
    if isinstance(error, RemoteError):
        return RemoteError(error.code, error.message)
    return type(error)(*error.args)


def settle(waiter: Any, outcome: Outcome) -> None:
    """Hand `outcome` to `waiter`, unless it stopped waiting (an asyncio waiter that was cancelled)."""
    if waiter.done():
        return
    if isinstance(outcome, BaseException):
        waiter.set_exception(outcome)
    else:
        waiter.set_result(outcome)


class ClientSide(Generic[W]):
    """The client end of one connection, without I/O. Not thread-safe: the blocking connection holds
    a lock around every call. Once `error` is set the connection is gone: every waiter has been
    handed back to fail, and every later request raises a copy of it."""

    def __init__(
        self, address: str, *, client_id: str | None = None, token: str | None = None, limits: Limits = DEFAULT_LIMITS
    ) -> None:
        """`token` defaults to `$QMQ_TOKEN`; `client_id` to host and process id."""
        self.address = address
        self.protocol = Connection(
            Role.CLIENT, limits=limits, token=resolve_token(token), client_id=client_id or default_client_id()
        )
        self.error: ConnectionError | None = None
        self.refusal: RemoteError | None = None  # the server's error frame that ended the connection
        self._waiters: dict[int, W] = {}

    def handshake(self, waiter: W) -> tuple[int, bytes]:
        """The handshake request's id and bytes, to write first; its reply settles `waiter` with the
        server's info (version, max_frame_bytes), or RemoteError when the server refuses it. A server
        that refused the connection before the handshake was written (over a connection cap) has its
        refusal raised here."""
        if self.error is not None:
            raise fresh_copy(self.refusal or self.error)
        request_id, data = self.protocol.start_handshake()
        self._waiters[request_id] = waiter
        return request_id, data

    def request(self, code: int, body: dict[str, Any] | None, waiter: W | None) -> tuple[int, bytes]:
        """A request's id and bytes; its reply settles `waiter` (None: a one-way request, which gets
        no reply). Raises ConnectionError when the connection is gone."""
        if self.error is not None:
            raise fresh_copy(self.error)
        request_id, data = self.protocol.send_request(code, body, oneway=waiter is None)
        if waiter is not None:
            self._waiters[request_id] = waiter
        return request_id, data

    def abandon(self, request_id: int) -> bool:
        """Stop waiting for a request (it timed out, or its caller was cancelled); its reply, if it
        ever comes, is dropped. False when its waiter was already handed back."""
        if self._waiters.pop(request_id, None) is None:
            return False
        self.protocol.abandon(request_id)
        return True

    def receive(self, data: bytes) -> list[tuple[W, Outcome]]:
        """The waiters that `data` settles, with their outcomes. An error frame about the whole
        connection ends it (`error` is set): every waiter left is handed back with the server's
        error. Raises `ProtocolError` when the server breaks the protocol."""
        self.protocol.receive_data(data)
        settled: list[tuple[W, Outcome]] = []
        while (event := self.protocol.next_event()) is not NEED_DATA:
            if isinstance(event, ErrorReply) and event.concerns_connection:
                refused = self.refusal = RemoteError(event.code, event.message)
                lost = self.lose(ConnectionError(f"{self.address} closed the connection: {refused}"))
                return settled + [(waiter, fresh_copy(refused)) for waiter in lost]
            waiter = self._waiters.pop(event.request_id, None)
            if waiter is None:
                continue
            if isinstance(event, Response):
                settled.append((waiter, event.body))
            elif isinstance(event, ErrorReply):
                settled.append((waiter, RemoteError(event.code, event.message)))
        return settled

    def lose(self, error: ConnectionError) -> list[W]:
        """End the connection (keeping the first reason) and hand back every waiter, for the
        connection class to fail with a copy of `error`."""
        if self.error is None:
            self.error = error
        waiters, self._waiters = list(self._waiters.values()), {}
        return waiters
