"""Errors a peer can cause. Every one carries an `ErrorCode` so it can travel back in an error frame."""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes carried by error frames and rejection results; stable on the wire."""

    BAD_FRAME = 1  # header or length field not understood
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    BAD_BODY = 4  # body is not valid msgpack, or not the shape the request needs
    HANDSHAKE_REQUIRED = 5
    UNAUTHORIZED = 6  # missing or wrong token
    UNKNOWN_REQUEST = 7
    MESSAGE_TOO_LARGE = 8
    BAD_SUBJECT = 9
    BAD_REQUEST = 10  # well-formed, but a field is missing or out of range
    UNAVAILABLE = 11  # the server cannot serve this now (read-only, shutting down, store error)
    TIMEOUT = 12
    READ_ONLY = 13  # this broker group takes no new messages now: send to another group
    UNKNOWN_CONSUMER = 14  # an ack or nack for a subject, group or consumer this broker never served
    NOT_MASTER = 15  # this server is not its group's master (the reply names it when known): ask the meta server
    FORBIDDEN = 16  # the credential may not do this (a subject outside its ACL, administration)
    INTERNAL = 99


class ProtocolError(Exception):
    """A peer broke the protocol or a limit. The server answers with an error frame; `fatal` errors
    also close the connection, because the byte stream can no longer be trusted."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool = True) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.fatal = fatal


class RemoteError(Exception):
    """The server answered a request with an error frame."""

    def __init__(self, code: int, message: str) -> None:
        try:
            name = ErrorCode(code).name
        except ValueError:
            name = f"error {code}"
        super().__init__(f"{name}: {message}")
        self.code = code
        self.message = message
