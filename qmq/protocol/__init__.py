"""The qmq wire protocol, free of I/O: frames, request codes, limits, errors and the per-connection
state machine that the asyncio server, the asyncio client and the blocking client all share.
See docs/protocol.md for the byte layout."""

from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import (
    NEED_DATA,
    Connection,
    ErrorReply,
    Event,
    HandshakeAccepted,
    Request,
    Response,
    Role,
)
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.frame import PROTOCOL_VERSION, Flags, Frame, FrameDecoder, encode_frame
from qmq.protocol.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "DEFAULT_LIMITS",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "Connection",
    "ErrorCode",
    "ErrorReply",
    "Event",
    "Flags",
    "Frame",
    "FrameDecoder",
    "HandshakeAccepted",
    "Limits",
    "ProtocolError",
    "RemoteError",
    "Request",
    "RequestCode",
    "Response",
    "Role",
    "encode_frame",
]
