"""Frames: the unit every qmq server and client exchange, and their encoder and incremental decoder.

A frame is a 4-byte big-endian length (of what follows, not of itself), a 9-byte header
(version u8, code u16, request id u32, flags u16) and a msgpack body that is a map or nil.
This module does no I/O: bytes go in, `Frame`s or a `ProtocolError` come out.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

import msgpack

from qmq.protocol.errors import ErrorCode, ProtocolError
from qmq.protocol.limits import DEFAULT_LIMITS, MAX_BODY_DEPTH, Limits
from qmq.protocol.packing import pack

PROTOCOL_VERSION = 1

LENGTH = struct.Struct(">I")
HEADER = struct.Struct(">BHIH")
LENGTH_BYTES = LENGTH.size  # 4
HEADER_BYTES = HEADER.size  # 9
NIL_BODY = msgpack.packb(None)
MAX_CODE = 0xFFFF
MAX_REQUEST_ID = 0xFFFF_FFFF
TLS_HANDSHAKE_RECORD, TLS_MAJOR_VERSION = 0x16, 0x03  # how a TLS ClientHello starts


class Flags(IntFlag):
    """Header flag bits. Any other bit set is a protocol error, so new bits need a new version."""

    RESPONSE = 1  # a reply to the request with the same request id
    ERROR = 2  # a reply whose body is {"code": ErrorCode, "message": str}; always with RESPONSE
    ONEWAY = 4  # a request that expects no reply


REQUEST = Flags(0)  # no bits: a request that expects a reply
KNOWN_FLAGS = Flags.RESPONSE | Flags.ERROR | Flags.ONEWAY
# The only meaningful combinations: a request, a one-way request, a reply, an error reply.
VALID_FLAG_SETS = frozenset({REQUEST, Flags.ONEWAY, Flags.RESPONSE, Flags.RESPONSE | Flags.ERROR})
_VALID_RAW_FLAGS = frozenset(int(f) for f in VALID_FLAG_SETS)  # ints: enum arithmetic costs µs per frame
_RESPONSE, _ERROR, _ONEWAY = int(Flags.RESPONSE), int(Flags.ERROR), int(Flags.ONEWAY)


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame. `body` is a dict or None; the decoder guarantees nothing else."""

    code: int
    request_id: int
    flags: int  # a combination of `Flags`, kept as a plain int
    body: dict[str, Any] | None
    version: int = PROTOCOL_VERSION
    # Set when the frame is whole but its body breaks a limit that leaves the stream intact (nesting
    # too deep): the frame is refused alone, the connection stays usable. `body` is None then.
    error: ProtocolError | None = None

    @property
    def is_response(self) -> bool:
        return bool(self.flags & _RESPONSE)

    @property
    def is_error(self) -> bool:
        return bool(self.flags & _ERROR)

    @property
    def oneway(self) -> bool:
        return bool(self.flags & _ONEWAY)


def encode_frame(
    code: int,
    request_id: int,
    body: dict[str, Any] | None = None,
    flags: Flags = REQUEST,
    *,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """Return the bytes of one frame.

    Raises a non-fatal `ProtocolError(FRAME_TOO_LARGE)` when the frame would exceed
    `limits.max_frame_bytes` (nothing was sent, the connection is still good), `ValueError` for a
    header field out of range or a body that is not a dict or None, and `TypeError` for a body
    msgpack cannot encode: those last two are the caller's bugs, not the peer's.
    """
    if not 0 <= code <= MAX_CODE:
        raise ValueError(f"code {code} is not a u16")
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request id {request_id} is not a u32")
    if flags not in _VALID_RAW_FLAGS:
        raise ValueError(f"flags {flags!r} are not a valid combination")
    if body is not None and not isinstance(body, dict):
        raise ValueError(f"a body must be a dict or None, not {type(body).__name__}")
    payload = NIL_BODY if body is None else pack(body)
    length = HEADER_BYTES + len(payload)
    if length > limits.max_frame_bytes:
        raise ProtocolError(
            ErrorCode.FRAME_TOO_LARGE,
            f"frame would be {length} bytes, the limit is {limits.max_frame_bytes}",
            fatal=False,
        )
    return LENGTH.pack(length) + HEADER.pack(PROTOCOL_VERSION, code, request_id, int(flags)) + payload


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed in a body")


# msgpack's per-object size limits: every one is `max_len` (decode_body).
_UNPACK_LIMITS = ("max_str_len", "max_bin_len", "max_array_len", "max_map_len", "max_ext_len")


def decode_body(payload: bytes | memoryview, max_len: int, max_depth: int = MAX_BODY_DEPTH) -> dict[str, Any] | None:
    """Decode a frame body; any failure becomes `ProtocolError(BAD_BODY)`.

    Map keys must be strings or bytes (msgpack's strict_map_key), extension types are refused, no
    string, bin, array or map may claim more than `max_len` elements, so a small body cannot make
    the decoder allocate much, and maps and lists may nest at most `max_depth` deep, so no handler
    (or repr, or re-encoding) of the body can hit Python's recursion limit. The error never quotes
    the body: a hostile peer must not be able to write megabytes into the server's log.
    """
    try:
        body = msgpack.unpackb(payload, raw=False, ext_hook=_refuse_ext, **dict.fromkeys(_UNPACK_LIMITS, max_len))
    except Exception as exc:  # unpackb raises many types (ExtraData, FormatError, StackError, ...)
        # Not repr(exc): ExtraData's repr holds the whole decoded body and the bytes after it.
        raise ProtocolError(ErrorCode.BAD_BODY, f"body is not valid msgpack ({type(exc).__name__})") from None
    if body is not None and not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_BODY, f"body must be a map or nil, not {type(body).__name__}")
    if body and not _shallow(body, max_depth):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"the body nests maps and lists more than {max_depth} deep", fatal=False
        )
    return body


_CONTAINERS = (dict, list)


def _shallow(body: dict[str, Any], max_depth: int) -> bool:
    """Whether no map or list in `body` lies more than `max_depth` levels deep. Iterative (a deep
    body must not overflow the stack here either) and visiting containers only."""
    level: list[Any] = [body]
    depth = 1
    while level:
        if depth > max_depth:
            return False
        below: list[Any] = []
        for container in level:
            for value in container.values() if type(container) is dict else container:
                if type(value) in _CONTAINERS:
                    below.append(value)
        level = below
        depth += 1
    return True


class FrameDecoder:
    """Incremental decoder: `feed()` bytes as they arrive, then call `next_frame()` until it
    returns None (more bytes needed).

    Promises: every call returns a `Frame`, None, or raises `ProtocolError`; each call either
    consumes a whole frame or returns/raises without consuming, so a loop over `next_frame()`
    always ends. The length field is checked against `limits.max_frame_bytes` as soon as its four
    bytes are in, and the header as soon as its nine are, before any body is waited for. After an
    error the decoder is broken for good: the byte stream can no longer be trusted, and every
    later call raises the same error.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS, max_frame_bytes: int | None = None) -> None:
        """`max_frame_bytes`: the limit to start with (default `limits.max_frame_bytes`); a server
        starts low and raises it once the handshake is accepted (`max_frame_bytes` is writable)."""
        self._limits = limits
        self.max_frame_bytes = limits.max_frame_bytes if max_frame_bytes is None else max_frame_bytes
        self._buffer = bytearray()
        self._error: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._error is None:
            self._buffer += data

    def next_frame(self) -> Frame | None:
        if self._error is not None:
            raise self._error
        try:
            return self._next_frame()
        except ProtocolError as exc:
            self._error = exc
            self._buffer.clear()
            raise

    def _next_frame(self) -> Frame | None:
        buffer = self._buffer
        if len(buffer) < LENGTH_BYTES:
            return None
        (length,) = LENGTH.unpack_from(buffer, 0)
        if length > self.max_frame_bytes:
            if buffer[0] == TLS_HANDSHAKE_RECORD and buffer[1] == TLS_MAJOR_VERSION:
                raise ProtocolError(ErrorCode.BAD_FRAME, "this looks like TLS, and this peer does not use TLS here")
            raise ProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"frame announces {length} bytes, the limit is {self.max_frame_bytes}"
                + ("" if self.max_frame_bytes == self._limits.max_frame_bytes else " before the handshake"),
            )
        if length < HEADER_BYTES:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"frame length {length} is shorter than the header")
        if len(buffer) < LENGTH_BYTES + HEADER_BYTES:
            return None
        version, code, request_id, raw_flags = HEADER.unpack_from(buffer, LENGTH_BYTES)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"frame version {version}, this peer speaks version {PROTOCOL_VERSION}",
            )
        if raw_flags not in _VALID_RAW_FLAGS:
            if raw_flags & ~int(KNOWN_FLAGS):
                raise ProtocolError(ErrorCode.BAD_FRAME, f"undefined flag bits 0x{raw_flags:04x}")
            raise ProtocolError(ErrorCode.BAD_FRAME, f"flags {Flags(raw_flags)!r} are not a valid combination")
        flags = raw_flags
        end = LENGTH_BYTES + length
        if len(buffer) < end:
            return None
        try:  # decoded in place (a reply can be megabytes: no copy of it first), consumed even if bad
            with memoryview(buffer) as view, view[LENGTH_BYTES + HEADER_BYTES : end] as payload:
                body = decode_body(payload, length, self._limits.max_body_depth)
        except ProtocolError as exc:
            if exc.fatal:
                raise
            return Frame(code=code, request_id=request_id, flags=flags, body=None, version=version, error=exc)
        finally:
            del buffer[:end]
        return Frame(code=code, request_id=request_id, flags=flags, body=body, version=version)
