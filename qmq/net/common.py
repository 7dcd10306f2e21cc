"""Settings and helpers shared by the asyncio and the blocking client."""

from __future__ import annotations

import os
import socket

from qmq.protocol.connection import ErrorReply
from qmq.protocol.errors import RemoteError

TOKEN_ENV = "QMQ_TOKEN"
CONNECT_TIMEOUT_S = 10.0  # TCP connect plus handshake
REQUEST_TIMEOUT_S = 30.0  # default wait for one reply
READ_CHUNK_BYTES = 256 * 1024  # at most this much is read from a socket at once


def default_client_id() -> str:
    """How a client names itself in server logs when not told: host and process id."""
    return f"{socket.gethostname()}:{os.getpid()}"


def resolve_token(token: str | None) -> str | None:
    """The explicit token, else `$QMQ_TOKEN`; an empty string means no token."""
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    return token or None


def connection_refused(address: str, event: ErrorReply) -> tuple[RemoteError, ConnectionError]:
    """For an error frame about the whole connection: the error for the requests in flight and the
    one for any request made afterwards (the server closes the connection next)."""
    remote = RemoteError(event.code, event.message)
    return remote, ConnectionError(f"{address} closed the connection: {remote}")


def fresh_copy(error: Exception) -> Exception:
    """A new exception like `error`, so each waiter raises its own object (tracebacks are per object)."""
    if isinstance(error, RemoteError):
        return RemoteError(error.code, error.message)
    return type(error)(*error.args)
