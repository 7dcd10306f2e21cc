"""The request side that every qmq server shares (broker, delay server, meta server): a table from
request code to handler, the request's body as a map, storage failures answered as UNAVAILABLE, and
per-request metrics. `qmq.net.server.Server` calls `Service.handle` for each request it reads.

A server subclasses `Service` and registers `async def handler(body) -> dict` in `handlers`; a
handler checks its fields with `qmq.protocol.fields` and `qmq.protocol.limits`, and raises
`ProtocolError` or `RemoteError` for an error frame. Promises, for every server alike: an unknown
request code is answered UNKNOWN_REQUEST and a body that is not a map BAD_BODY, the connection
staying usable; an exception of `storage_errors` (the server's store or database cannot take the
request now) is answered UNAVAILABLE naming the cause, never INTERNAL; every request counts in
`<prefix>_requests_total{request}`, `<prefix>_request_errors_total{request,error}` and
`<prefix>_request_seconds{request}`, request names being the codes' names in lower case
(`broker_send`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from qmq.metrics import RequestMetrics
from qmq.net.acl import authorize
from qmq.net.server import PeerInfo
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Request
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.fields import body_of

RequestHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any] | None]]


class Service:
    """Dispatch of requests to handlers. Subclasses set `name`, `log`, `storage_errors` and
    `storage`, and add their handlers to `self.handlers`."""

    name: ClassVar[str] = "server"  # "broker", "delay server", "meta server": in messages
    log: ClassVar[logging.Logger] = logging.getLogger("qmq.net")
    storage: ClassVar[str] = "store"  # what `storage_errors` come from, in the UNAVAILABLE message
    storage_errors: ClassVar[tuple[type[BaseException], ...]] = ()

    def __init__(self, request_metrics: RequestMetrics) -> None:
        """`request_metrics`: the server's, made once per process with its registry."""
        self.handlers: dict[int, RequestHandler] = {RequestCode.PING: self._ping}
        self.request_metrics = request_metrics
        self._storage_cause: str | None = None  # the last storage failure logged

    async def handle(self, request: Request, peer: PeerInfo) -> dict[str, Any] | None:
        """Answer one request (the `Handler` of `qmq.net.server.Server`)."""
        started = time.perf_counter()
        label = request_name(request.code)
        try:
            handler = self.handlers.get(request.code)
            if handler is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_REQUEST, f"the {self.name} has no request code {request.code}", fatal=False
                )
            body = body_of(request.body)
            if peer.principal is not None:
                authorize(peer.principal, request.code, body)
            try:
                return await handler(body)
            except self.storage_errors as exc:
                cause = self.storage_failed(exc)
                raise RemoteError(
                    ErrorCode.UNAVAILABLE, f"the {self.name}'s {self.storage} is unavailable: {cause}"
                ) from None
        except (ProtocolError, RemoteError) as exc:
            self.request_metrics.error(label, error_name(exc.code))
            if isinstance(exc, ProtocolError) and exc.fatal:
                self.log.warning("%s: %s, closing", peer, exc)
            raise
        finally:
            self.request_metrics.observe(label, time.perf_counter() - started)

    def storage_failed(self, exc: BaseException) -> str:
        """A request met a storage failure: log it (once while the cause stays the same) and return
        the cause to answer with."""
        cause = str(exc)
        if cause != self._storage_cause:
            self._storage_cause = cause
            self.log.error("the %s's %s cannot take requests: %s", self.name, self.storage, cause)
        return cause

    async def _ping(self, body: dict[str, Any]) -> dict[str, Any]:
        return body


@functools.cache
def request_name(code: int) -> str:
    """A request code's name in metrics and logs: `broker_send`, or `unknown`."""
    try:
        return RequestCode(code).name.lower()
    except ValueError:
        return "unknown"


def error_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return str(code)
