"""A server's membership in the cluster: register with the meta server, heartbeat, and unregister at a
clean shutdown. Brokers and delay servers share it.

The meta server may be down, slow or restarting: membership keeps trying (with backoff) and never
takes its server down; it logs once when the meta server is lost and once when it is back. The meta
server's answer carries the group's read-only flag, which is passed to `on_read_only`.

`meta` may list several meta servers (`A,B,C`): a failed call moves on to the next, and while another
is left to try, a call waits only for its share of the time before the server would fence itself
(`answer_by`), so a hung meta server (connection open, no answer) costs a master no writes. A server of a
replicated group adds its role, epoch and log end to each heartbeat (`report`) and learns its
group's master and epoch from the answer (`on_reply`); `last_reply_at` tells it how long it has been
without the meta server (a master fences itself after a while: docs/replication.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from qmq.net.aio_client import AsyncConnection
from qmq.net.common import CONNECT_TIMEOUT_S
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteError

log = logging.getLogger("qmq.membership")

RECONNECT_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # waits between failed attempts, the last repeated
REQUEST_TIMEOUT_S = 5.0  # the wait for an answer when no other meta server is left to try
MIN_REPLY_WAIT_S = 0.25  # the least a meta server is given to answer before the next one is tried


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


class Membership:
    def __init__(
        self,
        meta: str,
        *,
        kind: str,
        group: str | None,
        address: str,
        external_address: str | None = None,
        token: str | None = None,
        on_read_only: Callable[[bool], None] | None = None,
        report: Callable[[], dict[str, Any]] | None = None,
        on_reply: Callable[[dict[str, Any]], None] | None = None,
        answer_by: Callable[[], float | None] | None = None,
    ) -> None:
        self.metas = [m.strip() for m in meta.split(",") if m.strip()]
        self.meta = self.metas[0]
        self.report = report
        self.on_reply = on_reply
        self.answer_by = answer_by  # the monotonic time by which an answer is needed (a master fences itself then)
        self.last_reply_at = time.monotonic()  # when a meta server last answered
        self._poke = asyncio.Event()
        self.kind = kind
        self.group = group
        self.address = address
        self.external_address = external_address  # for clients outside the network (qmq.meta.listeners)
        self.token = token
        self.on_read_only = on_read_only or (lambda read_only: None)
        self.registered = asyncio.Event()
        self._conn: AsyncConnection | None = None
        self._task: asyncio.Task[None] | None = None

    def poke(self) -> None:
        """Heartbeat now (a role changed), not at the next interval."""
        self._poke.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="qmq-membership")

    async def _call(self, code: RequestCode, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
        if self._conn is None or self._conn.closed:
            host, port = split_address(self.meta)
            # A hung meta server accepts the TCP connection but never the handshake: the connect waits
            # no longer than the call would (as in the client's pool).
            connect_s = min(CONNECT_TIMEOUT_S, timeout)
            self._conn = await AsyncConnection.open(
                host, port, token=self.token, client_id=f"{self.kind}-{self.address}", timeout=connect_s
            )
        return await self._conn.request(code, body, timeout=timeout) or {}

    def reply_timeout(self, left_to_try: int) -> float:
        """How long to wait for the current meta server when `left_to_try` meta servers, it included,
        are left in this round. With others left and `answer_by` known: an equal share of the time
        until then (at least MIN_REPLY_WAIT_S), so the last one still has its share; else
        REQUEST_TIMEOUT_S (a slow answer is better than none)."""
        deadline = self.answer_by() if self.answer_by is not None else None
        if left_to_try <= 1 or deadline is None:
            return REQUEST_TIMEOUT_S
        share = (deadline - time.monotonic()) / left_to_try
        return round(min(REQUEST_TIMEOUT_S, max(MIN_REPLY_WAIT_S, share)), 3)

    async def _run(self) -> None:
        body = {"kind": self.kind, "group": self.group, "address": self.address}
        if self.external_address:
            body["external_address"] = self.external_address
        failures = 0
        code = RequestCode.META_REGISTER
        while True:
            try:
                timeout = self.reply_timeout(len(self.metas) - failures % len(self.metas))
                reply = await self._call(code, {**body, **self.report()} if self.report else body, timeout)
            except (OSError, ConnectionError, TimeoutError, RemoteError) as exc:
                if failures == 0:
                    log.warning("meta server %s not reachable, retrying: %s", self.meta, exc)
                failures += 1
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                if len(self.metas) > 1:  # the next meta server, after a pause once round the list
                    self.meta = self.metas[(self.metas.index(self.meta) + 1) % len(self.metas)]
                    if failures % len(self.metas):
                        continue
                wait = RECONNECT_BACKOFF_S[min(failures // len(self.metas), len(RECONNECT_BACKOFF_S) - 1)]
                await asyncio.sleep(wait)
                continue
            self.last_reply_at = time.monotonic()
            if not self.registered.is_set():
                what = (self.meta, self.kind, self.address, self.group)
                log.info("registered with meta server %s as %s %s in group %s", *what)
            elif failures:
                log.info("heartbeating to meta server %s now (%d attempts failed before)", self.meta, failures)
            failures = 0
            code = RequestCode.META_HEARTBEAT
            self.registered.set()
            self.on_read_only(bool(reply.get("read_only")))
            if self.on_reply is not None:
                self.on_reply(reply)
            self._poke.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(float(reply.get("heartbeat_interval_s", 10))):
                    await self._poke.wait()

    async def close(self) -> None:
        """Stop heartbeating and unregister (best effort: the meta server times us out otherwise)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(OSError, ConnectionError, TimeoutError, RemoteError):
            await self._call(RequestCode.META_UNREGISTER, {"address": self.address})
        if self._conn is not None:
            await self._conn.close()
