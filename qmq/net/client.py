"""The blocking client, for code without an event loop (Django and Flask apps, scripts, workers).

One `BlockingConnection` may be shared by any number of threads: each `request()` waits for its own
reply while a background reader thread matches replies to waiters by request id. It makes the same
promises as the asyncio client: the reply's body, or `RemoteError`, `TimeoutError` or
`ConnectionError` (the connection is gone: every waiter fails at once, and so does every later
request). A connection belongs to the process that opened it: after a fork, open a new one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
from concurrent.futures import Future
from typing import Any

from qmq.net.common import (
    READ_CHUNK_BYTES,
    REQUEST_TIMEOUT_S,
    ClientSide,
    Outcome,
    fresh_copy,
    settle,
)
from qmq.net.opening import Opener, tls_failed
from qmq.net.tls import closed_before_handshake_hint
from qmq.protocol.errors import ProtocolError

READER_JOIN_TIMEOUT_S = 5.0  # close() waits this long for the reader thread to end

_Reply = Future[dict[str, Any] | None]


class BlockingConnection(Opener["BlockingConnection"]):
    """Open with `BlockingConnection.open(...)` (qmq/net/opening.py); usable as a context manager.

    Two locks, so that a thread blocked writing a large request never stops the reader thread from
    taking replies off the socket (which could deadlock with a server that is itself blocked
    writing): `_send_lock` keeps frames whole and in request-id order on the socket, `_state_lock`
    guards the client side (protocol state and waiters) and is only held for short, non-blocking work.
    """

    def __init__(self, sock: socket.socket, side: ClientSide[_Reply]) -> None:
        """Use `open()`; this only wires the parts together."""
        self.address = side.address
        self.server_info: dict[str, Any] = {}  # the handshake reply: version, max_frame_bytes
        self._sock = sock
        self._side = side
        self._pid = os.getpid()
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._reader = threading.Thread(target=self._read_loop, name=f"qmq-reader-{self.address}", daemon=True)

    @classmethod
    def _connect(
        cls, host: str, port: int, side: ClientSide[_Reply], tls: ssl.SSLContext | None, timeout: float
    ) -> BlockingConnection:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap_socket(sock, server_hostname=host)
            except ssl.SSLError as exc:
                sock.close()
                raise tls_failed(side.address, exc) from None
            except BaseException:
                sock.close()
                raise
        sock.settimeout(None)  # the reader thread blocks in recv(); waits are bounded per request
        self = cls(sock, side)
        try:
            # Written before the reader thread starts: with TLS, a write alongside the reader's first
            # SSL_read (which takes the TLS 1.3 session tickets) could hang (one open in ~25).
            request_id, future = self._submit(handshake=True)
            assert future is not None
            self._reader.start()
            self.server_info = self._wait(request_id, future, timeout) or {}
        except BaseException:
            self.close()
            raise
        return self

    @property
    def closed(self) -> bool:
        return self._side.error is not None

    def request(
        self, code: int, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> dict[str, Any]:
        """Send a request and wait for the reply's body ({} for an empty one). Thread-safe."""
        request_id, future = self._submit(code, body)
        assert future is not None
        return self._wait(request_id, future, timeout) or {}

    def start(self, code: int, body: dict[str, Any] | None = None) -> _Reply:
        """Send a request without waiting: a Future the reader thread completes with the reply's body
        (None for an empty one) or its error. Nothing times it out: a caller that gives up on it just
        stops looking. Raises ConnectionError when the request cannot be sent. Thread-safe."""
        _, future = self._submit(code, body)
        assert future is not None
        return future

    def send_oneway(self, code: int, body: dict[str, Any] | None = None) -> None:
        """Send a request that gets no reply, not even an error. Thread-safe."""
        self._submit(code, body, oneway=True)

    def close(self) -> None:
        """Close the connection; requests in flight fail with ConnectionError. Idempotent."""
        if os.getpid() != self._pid:  # a forked copy: only drop the descriptor, the parent still uses it
            self._sock.close()
            return
        self._lose(ConnectionError(f"connection to {self.address} was closed by this client"))
        if threading.current_thread() is not self._reader and self._reader.is_alive():
            self._reader.join(READER_JOIN_TIMEOUT_S)
        self._sock.close()

    def __enter__(self) -> BlockingConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _submit(
        self,
        code: int = 0,
        body: dict[str, Any] | None = None,
        *,
        oneway: bool = False,
        handshake: bool = False,
    ) -> tuple[int, _Reply | None]:
        if os.getpid() != self._pid:
            raise RuntimeError(f"this connection belongs to process {self._pid}; open a new one after a fork")
        future: _Reply | None = None if oneway else Future()
        with self._send_lock:
            with self._state_lock:
                if handshake:
                    request_id, data = self._side.handshake(future)
                else:
                    request_id, data = self._side.request(code, body, future)
            try:
                self._sock.sendall(data)
            except OSError as exc:
                # The stream may hold half a frame now: the connection cannot be used any more.
                error = ConnectionError(f"connection to {self.address} was lost: {exc}")
                self._lose(error)
                raise fresh_copy(error) from exc
        return request_id, future

    def _wait(self, request_id: int, future: _Reply, timeout: float) -> dict[str, Any] | None:
        try:
            return future.result(timeout)
        except TimeoutError:
            with self._state_lock:
                still_waiting = self._side.abandon(request_id)
            if not still_waiting:  # the reader (or close) took it a moment ago and is about to set it
                return future.result()
            raise TimeoutError(f"no reply from {self.address} within {timeout:g} s") from None

    def _read_loop(self) -> None:
        hint = closed_before_handshake_hint(self._tls)
        error = ConnectionError(f"connection to {self.address} was closed by the server{hint}")
        try:
            while data := self._sock.recv(READ_CHUNK_BYTES):
                with self._state_lock:
                    settled = self._side.receive(data)
                    refused = self._side.error is not None
                self._settle(settled)  # outside the lock: waking waiters runs no code of ours
                if refused:  # the server refused the whole connection, and closes it next
                    self._lose(self._side.error)
                    return
                if self._side.protocol.handshake_done:
                    error = ConnectionError(f"connection to {self.address} was closed by the server")
        except ProtocolError as exc:
            error = ConnectionError(f"{self.address} broke the protocol: {exc}")
        except OSError as exc:
            error = ConnectionError(f"connection to {self.address} was lost: {exc}")
        self._lose(error)

    def _lose(self, error: ConnectionError) -> None:
        """Mark the connection dead (keeping the first reason), shut the socket down, which wakes
        the reader thread, and fail every waiter with the reason."""
        with self._state_lock:
            waiters = self._side.lose(error)
            reason = self._side.error
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._settle([(waiter, fresh_copy(reason)) for waiter in waiters])

    @staticmethod
    def _settle(settled: list[tuple[_Reply, Outcome]]) -> None:
        for waiter, outcome in settled:
            settle(waiter, outcome)
