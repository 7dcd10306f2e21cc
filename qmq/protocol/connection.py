"""The protocol state machine of one connection, client or server side, without any I/O.

Bytes that arrived go in with `receive_data()`; `next_event()` turns them into events. Methods
that send return the bytes to write. The asyncio server, the asyncio client and the blocking
client all drive this one class, so the rules below hold for every qmq server and client:

- The client's first frame is a HANDSHAKE request; the server answers it before anything else.
  The client may pipeline requests behind it without waiting for the answer.
- Requests are matched to replies by request id, which the client allocates (1..2**32-1, wrapping,
  never one still in flight). Replies may come in any order.
- Request id 0 is never allocated: an error frame with request id 0 concerns the whole connection,
  and the server closes the connection after sending it.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass
from typing import Any, Literal

from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, ProtocolError
from qmq.protocol.frame import (
    MAX_REQUEST_ID,
    PROTOCOL_VERSION,
    REQUEST,
    Flags,
    Frame,
    FrameDecoder,
    encode_frame,
)
from qmq.protocol.limits import DEFAULT_LIMITS, Limits

CONNECTION_REQUEST_ID = 0  # the request id of error frames about the whole connection
MAX_CLIENT_ID_LEN = 200  # characters
MAX_TOKEN_LEN = 512  # characters of a credential presented in a handshake
MAX_ERROR_MESSAGE_LEN = 1000  # characters; longer messages are cut so an error frame stays small


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class _NeedData(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA = _NeedData.NEED_DATA
"""Returned by `next_event()` when no whole frame is buffered: feed more bytes."""


@dataclass(frozen=True, slots=True)
class Request:
    """Server side: a request to handle. Answer it unless `oneway`."""

    request_id: int
    code: int
    body: dict[str, Any] | None
    oneway: bool = False
    error: ProtocolError | None = None  # the request is refused with this before any handler sees it


@dataclass(frozen=True, slots=True)
class Response:
    """Client side: the reply to request `request_id`; `code` echoes the request's code."""

    request_id: int
    code: int
    body: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Client side: the server refused request `request_id` (or, for request id 0, the whole
    connection, which it closes next). `code` is usually an `ErrorCode`."""

    request_id: int
    code: int
    message: str

    @property
    def concerns_connection(self) -> bool:
        return self.request_id == CONNECTION_REQUEST_ID


@dataclass(frozen=True, slots=True)
class HandshakeAccepted:
    """Server side: a client passed the handshake. `reply` holds the answer the server must write;
    `client_id` is what the client calls itself, worth a log line."""

    client_id: str
    version: int
    reply: bytes
    # Set when the client presented a token other than the shared one to a server that takes
    # per-application credentials: the server must check it (`qmq.net.server`) before writing `reply`.
    credential: str | None = None


Event = Request | Response | ErrorReply | HandshakeAccepted


class Connection:
    """One end of a qmq connection. See the module docstring for the rules it enforces.

    `next_event()` raises `ProtocolError` when the peer breaks the protocol; the error is fatal
    (the server answers it with `send_error(0, ...)` and closes) and every later call raises it
    again. Misuse by the local program (sending a response as a client, say) raises RuntimeError.
    """

    def __init__(
        self,
        role: Role,
        *,
        limits: Limits = DEFAULT_LIMITS,
        token: str | None = None,
        client_id: str = "",
        accept_credentials: bool = False,
    ) -> None:
        """`token`: on a server, the token every client must present (None: no token needed); on a
        client, the token to present. `client_id` names a client in the server's logs. A server with
        `accept_credentials` also lets a handshake with another token through, marked as a
        credential for the server to check."""
        self.role = role
        self.accept_credentials = accept_credentials
        self.limits = limits
        self.token = token
        self.client_id = client_id
        self.handshake_done = False  # server: a handshake was accepted; client: its reply arrived
        # A server reads small frames only until the client has passed the handshake.
        self._decoder = FrameDecoder(limits, limits.max_handshake_frame_bytes if role is Role.SERVER else None)
        self._error: ProtocolError | None = None
        self._handshake_sent = False
        self._handshake_id: int | None = None
        self._pending: dict[int, bool] = {}  # client: request id in flight -> abandoned
        self._next_id = 1

    # -- receiving -----------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._decoder.feed(data)

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not yet turned into events: what this connection holds in memory."""
        return self._decoder.buffered_bytes

    def next_event(self) -> Event | Literal[_NeedData.NEED_DATA]:
        if self._error is not None:
            raise self._error
        try:
            while True:
                frame = self._decoder.next_frame()
                if frame is None:
                    return NEED_DATA
                event = self._server_event(frame) if self.role is Role.SERVER else self._client_event(frame)
                if event is not None:
                    return event
        except ProtocolError as exc:
            self._error = exc
            raise

    def _server_event(self, frame: Frame) -> Event:
        if frame.is_response:
            raise ProtocolError(ErrorCode.BAD_FRAME, "a client sent a reply frame")
        if not self.handshake_done:
            if frame.error is not None:
                raise ProtocolError(frame.error.code, frame.error.message)
            if frame.code != RequestCode.HANDSHAKE:
                raise ProtocolError(
                    ErrorCode.HANDSHAKE_REQUIRED, f"the first request must be a handshake, not {frame.code}"
                )
            return self._accept_handshake(frame)
        if frame.code == RequestCode.HANDSHAKE:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a second handshake on one connection")
        return Request(frame.request_id, frame.code, frame.body, frame.oneway, frame.error)

    def _accept_handshake(self, frame: Frame) -> HandshakeAccepted:
        body = frame.body or {}
        version, client_id, token = body.get("version"), body.get("client_id"), body.get("token")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ProtocolError(ErrorCode.BAD_BODY, "handshake needs an integer 'version'")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"client speaks version {version}, this server speaks version {PROTOCOL_VERSION}",
            )
        if not isinstance(client_id, str) or not 0 < len(client_id) <= MAX_CLIENT_ID_LEN:
            raise ProtocolError(
                ErrorCode.BAD_BODY, f"handshake needs a 'client_id' of 1-{MAX_CLIENT_ID_LEN} characters"
            )
        credential = None
        if self.token is not None and not (
            isinstance(token, str) and hmac.compare_digest(token.encode(), self.token.encode())
        ):
            if not (self.accept_credentials and isinstance(token, str) and 0 < len(token) <= MAX_TOKEN_LEN):
                raise ProtocolError(
                    ErrorCode.UNAUTHORIZED, "a token is required" if token is None else "the token is wrong"
                )
            credential = token
        self.handshake_done = True
        self._decoder.max_frame_bytes = self.limits.max_frame_bytes
        reply = self.send_response(
            frame.request_id,
            RequestCode.HANDSHAKE,
            {"version": PROTOCOL_VERSION, "max_frame_bytes": self.limits.max_frame_bytes},
        )
        return HandshakeAccepted(client_id=client_id, version=version, reply=reply, credential=credential)

    def _client_event(self, frame: Frame) -> Event | None:
        if not frame.is_response:
            raise ProtocolError(ErrorCode.BAD_FRAME, "a server sent a request frame")
        if frame.error is not None:
            raise ProtocolError(ErrorCode.BAD_BODY, f"a reply broke a limit: {frame.error.message}")
        if frame.is_error:
            body = frame.body or {}
            code, message = body.get("code"), body.get("message")
            if not isinstance(code, int) or isinstance(code, bool) or not isinstance(message, str):
                raise ProtocolError(ErrorCode.BAD_BODY, "error frame without 'code' or 'message'")
            if frame.request_id == CONNECTION_REQUEST_ID:
                return ErrorReply(frame.request_id, code, message)
            event: Response | ErrorReply = ErrorReply(frame.request_id, code, message)
        else:
            event = Response(frame.request_id, frame.code, frame.body)
        if frame.request_id not in self._pending:
            raise ProtocolError(ErrorCode.BAD_FRAME, f"a reply to request {frame.request_id}, not in flight")
        abandoned = self._pending.pop(frame.request_id)
        if frame.request_id == self._handshake_id:
            self.handshake_done = isinstance(event, Response)
        return None if abandoned else event

    # -- sending ---------------------------------------------------------------------------------

    def start_handshake(self) -> tuple[int, bytes]:
        """Client: the handshake request, to write first. Its reply arrives as a `Response` (or an
        `ErrorReply` when refused) with the returned request id."""
        self._require(Role.CLIENT)
        if self._handshake_sent:
            raise RuntimeError("the handshake was already sent")
        body = {"version": PROTOCOL_VERSION, "client_id": self.client_id, "token": self.token}
        request_id, data = self._send(RequestCode.HANDSHAKE, body, oneway=False)
        self._handshake_sent, self._handshake_id = True, request_id
        return request_id, data

    def send_request(self, code: int, body: dict[str, Any] | None = None, *, oneway: bool = False) -> tuple[int, bytes]:
        """Client: a request; returns its request id and the bytes to write. A one-way request gets
        no reply. Raises a non-fatal `ProtocolError(FRAME_TOO_LARGE)` before allocating anything
        if the frame would exceed the limit."""
        self._require(Role.CLIENT)
        if not self._handshake_sent:
            raise RuntimeError("start_handshake() must come first")
        return self._send(code, body, oneway=oneway)

    def abandon(self, request_id: int) -> None:
        """Client: stop waiting for a request (it timed out, say). Its reply, if it ever comes, is
        dropped silently instead of being a protocol error."""
        if request_id in self._pending:
            self._pending[request_id] = True

    @property
    def in_flight(self) -> int:
        """Client: requests sent and not yet answered (abandoned ones included)."""
        return len(self._pending)

    def send_response(self, request_id: int, code: int, body: dict[str, Any] | None) -> bytes:
        """Server: the reply to request `request_id` (`code` should echo the request's)."""
        self._require(Role.SERVER)
        return encode_frame(code, request_id, body, Flags.RESPONSE, limits=self.limits)

    def send_error(self, request_id: int, code: ErrorCode | int, message: str) -> bytes:
        """Server: an error frame refusing request `request_id`, or the connection when it is 0."""
        self._require(Role.SERVER)
        body = {"code": int(code), "message": message[:MAX_ERROR_MESSAGE_LEN]}
        return encode_frame(0, request_id, body, Flags.RESPONSE | Flags.ERROR, limits=self.limits)

    def _send(self, code: int, body: dict[str, Any] | None, *, oneway: bool) -> tuple[int, bytes]:
        request_id = self._allocate_id()
        data = encode_frame(code, request_id, body, Flags.ONEWAY if oneway else REQUEST, limits=self.limits)
        if not oneway:
            self._pending[request_id] = False
        self._next_id = request_id % MAX_REQUEST_ID + 1
        return request_id, data

    def _allocate_id(self) -> int:
        if len(self._pending) >= MAX_REQUEST_ID:
            raise RuntimeError("every request id is in flight")
        request_id = self._next_id
        while request_id in self._pending:
            request_id = request_id % MAX_REQUEST_ID + 1
        return request_id

    def _require(self, role: Role) -> None:
        if self.role is not role:
            raise RuntimeError(f"only a {role.value} connection can do this")
