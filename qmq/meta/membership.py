"""A server's membership in the cluster: register with the meta server, heartbeat, and unregister at a
clean shutdown. Brokers and delay servers share it.

The meta server may be down, slow or restarting: membership keeps trying (with backoff) and never
takes its server down; it logs once when the meta server is lost and once when it is back. The meta
server's answer carries the group's read-only flag, which is passed to `on_read_only`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteError

log = logging.getLogger("qmq.membership")

RECONNECT_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # waits between failed attempts, the last repeated
REQUEST_TIMEOUT_S = 5.0


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
    ) -> None:
        self.meta = meta
        self.kind = kind
        self.group = group
        self.address = address
        self.external_address = external_address  # for clients outside the network (qmq.meta.listeners)
        self.token = token
        self.on_read_only = on_read_only or (lambda read_only: None)
        self.registered = asyncio.Event()
        self._conn: AsyncConnection | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="qmq-membership")

    async def _call(self, code: RequestCode, body: dict) -> dict:
        if self._conn is None or self._conn.closed:
            host, port = split_address(self.meta)
            self._conn = await AsyncConnection.open(
                host, port, token=self.token, client_id=f"{self.kind}-{self.address}"
            )
        return await self._conn.request(code, body, timeout=REQUEST_TIMEOUT_S) or {}

    async def _run(self) -> None:
        body = {"kind": self.kind, "group": self.group, "address": self.address}
        if self.external_address:
            body["external_address"] = self.external_address
        failures = 0
        code = RequestCode.META_REGISTER
        while True:
            try:
                reply = await self._call(code, body)
            except (OSError, ConnectionError, TimeoutError, RemoteError) as exc:
                if failures == 0:
                    log.warning("meta server %s not reachable, retrying: %s", self.meta, exc)
                wait = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
                failures += 1
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                await asyncio.sleep(wait)
                continue
            if failures or not self.registered.is_set():
                log.info(
                    "registered with meta server %s as %s %s in group %s",
                    self.meta,
                    self.kind,
                    self.address,
                    self.group,
                )
            failures = 0
            code = RequestCode.META_HEARTBEAT
            self.registered.set()
            self.on_read_only(bool(reply.get("read_only")))
            await asyncio.sleep(float(reply.get("heartbeat_interval_s", 10)))

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
