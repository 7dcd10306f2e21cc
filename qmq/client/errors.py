"""The errors a qmq client raises, and how it names a broker's error codes.

`ClientError` and its kinds say what a caller cannot work around (`SendError` stands beside the
`SendResult` it carries, in `qmq.client.messages`). `InvalidMessage` and `InvalidSubscription` are
refusals made before anything is sent: they carry the `ErrorCode` a broker would have answered,
because the client checks with the broker's own functions (`qmq.protocol.limits`).
"""

from __future__ import annotations

from qmq.protocol.errors import ErrorCode


class ClientError(Exception):
    """A problem a qmq client cannot work around, said so that the user can act on it."""


class MetaUnreachable(ClientError):
    """The meta server could not be asked for a route. `code`: the error it answered with, when it
    answered (a wrong token, a refusal), None when it could not be reached; `tls_refused`: its TLS
    handshake failed (a setting to fix, not a moment to wait out)."""

    def __init__(self, message: str, code: int | None = None, *, tls_refused: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.tls_refused = tls_refused


class ClientClosed(ClientError, ConnectionError):
    """The client was closed: nothing more goes through it (a send waiting for a broker ends)."""

    def __init__(self) -> None:
        super().__init__("this client was closed")


class NoRoute(ClientError):
    """No broker group carries the subject (none registered, or every one is unavailable)."""


class Refused(ValueError):
    """Something no broker would accept, found before sending; `code` is the error a broker answers
    with when sent the same thing."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class InvalidMessage(Refused):
    """A message no broker would accept (subject, id, key, tags, size)."""


class InvalidSubscription(Refused):
    """A subscription no broker would serve (subject, group, consumer id, tags, start)."""


class ConnectFailed(ConnectionError):
    """No connection could be opened to `address` (nothing listens, unreachable, timed out, or
    `tls_refused`: its TLS handshake failed, a setting to fix rather than wait out)."""

    def __init__(self, address: str, reason: str, *, tls_refused: bool = False) -> None:
        super().__init__(f"cannot connect to {address}: {reason}")
        self.address = address
        self.reason = reason
        self.tls_refused = tls_refused


def error_name(code: int | None) -> str:
    """`ErrorCode` name of a code from a broker's reply ("error N" for one this client does not know)."""
    if code is None:
        return "ERROR"
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error {code}"
