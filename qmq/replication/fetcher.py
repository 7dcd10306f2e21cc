"""A replica's fetcher: copies its group master's message log into the local store, record for
record, CRC-checked, fsynced before the next fetch reports the new offset (docs/replication.md).

It long-polls REPL_FETCH; each request's `offset` is the local durable end, which is the master's
acknowledgement. Far behind (a new or wiped replica), it asks for bigger chunks. A master that says
it is not master, or that this replica's log runs past its own, is reported to the server
(`on_trouble`), which asks the meta server again and truncates if it must. `on_durable(end)` runs
after each chunk is durable, before the next fetch: what the server derives from the log beyond the
store's own files (a delay server's buckets) keeps up with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.store import epochs as ep
from qmq.store.replication import CATCH_UP_CHUNK_BYTES, DEFAULT_CHUNK_BYTES, ChunkError
from qmq.store.store import LogStore

log = logging.getLogger("qmq.replica")

FETCH_WAIT_MS = 500  # a fetch waits this long for new records before answering empty
RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)  # between failed fetches, the last repeated
REPLY_GRACE_S = 10.0  # a fetch's reply may come this long after its wait
INLINE_APPEND_BYTES = 256 * 1024  # smaller chunks are written on the event loop


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


async def ask_epoch_end(master: str, epoch: int, *, token: str | None, client_id: str) -> int:
    """REPL_EPOCH_END: where `epoch` ends in `master`'s log."""
    host, port = split_address(master)
    conn = await AsyncConnection.open(host, port, token=token, client_id=client_id)
    try:
        reply = await conn.request(RequestCode.REPL_EPOCH_END, {"epoch": epoch}, timeout=REPLY_GRACE_S)
    finally:
        await conn.close()
    return int(reply["end_offset"])


class Fetcher:
    def __init__(
        self,
        store: LogStore,
        *,
        group: str,
        address: str,
        master: str,
        epoch: int,
        epochs: ep.Epochs,
        save_epochs: Callable[[ep.Epochs], None],
        token: str | None = None,
        on_trouble: Callable[[RemoteError], None] = lambda exc: None,
        on_unreachable: Callable[[], None] = lambda: None,
        on_durable: Callable[[int], Awaitable[None]] | None = None,
        wait_ms: int = FETCH_WAIT_MS,
    ) -> None:
        self.store = store
        self.group = group
        self.address = address
        self.master = master
        self.epoch = epoch
        self.epochs = epochs
        self.save_epochs = save_epochs
        self.token = token
        self.on_trouble = on_trouble
        self.on_unreachable = on_unreachable
        self.on_durable = on_durable
        self.wait_ms = wait_ms
        self.master_end = 0  # the master's log end in its last reply
        self.damaged_at: int | None = None  # a record of the master's that failed its CRC here: told in the next fetch
        self.fetches = 0
        self._task: asyncio.Task[None] | None = None
        self._conn: AsyncConnection | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="qmq-replica-fetcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._fetch_once()
                if failures:
                    log.info("fetching from master %s again", self.master)
                failures = 0
                continue
            except RemoteError as exc:
                if failures == 0:
                    log.warning("master %s refused a fetch: %s", self.master, exc)
                if exc.code in (ErrorCode.NOT_MASTER, ErrorCode.BAD_REQUEST):
                    self.on_trouble(exc)
            except (OSError, ConnectionError, TimeoutError) as exc:
                if failures == 0:
                    log.warning("cannot fetch from master %s: %s", self.master, exc)
                await self._drop_connection()
                self.on_unreachable()  # the meta server may have promoted someone: ask it now
            except ChunkError as exc:
                log.error("master %s sent a chunk that fails its checks, fetching it again: %s", self.master, exc)
                self.damaged_at = exc.offset  # the master mends its copy, or cuts it out (mending.py)
            failures += 1
            await asyncio.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1])

    async def _drop_connection(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _fetch_once(self) -> None:
        if self._conn is None or self._conn.closed:
            host, port = split_address(self.master)
            self._conn = await AsyncConnection.open(host, port, token=self.token, client_id=f"replica-{self.address}")
        offset = self.store.end_offset
        behind = self.master_end - offset > DEFAULT_CHUNK_BYTES
        body = {
            "group": self.group,
            "replica": self.address,
            "epoch": self.epoch,
            "offset": offset,
            "max_bytes": CATCH_UP_CHUNK_BYTES if behind else DEFAULT_CHUNK_BYTES,
            "wait_ms": 0 if behind else self.wait_ms,
        }
        if self.damaged_at is not None:
            body["damaged_at"] = self.damaged_at
        reply = await self._conn.request(RequestCode.REPL_FETCH, body, timeout=self.wait_ms / 1000 + REPLY_GRACE_S)
        self.fetches += 1
        data = reply.get("data") or b""
        self.master_end = int(reply.get("end", 0))
        if data:
            if len(data) <= INLINE_APPEND_BYTES:  # a few writes: cheaper than a thread hop
                end = self.store.append_replicated(bytes(data), offset)
            else:
                end = await asyncio.to_thread(self.store.append_replicated, bytes(data), offset)
            self.damaged_at = None
            await self.store.flushed(end)  # durable before the next fetch reports it
            if self.on_durable is not None:
                await self.on_durable(end)
        masters = [(int(e), int(s)) for e, s in reply.get("epochs") or ()]
        merged = ep.merged(self.epochs, masters, self.store.end_offset)
        if merged != self.epochs:
            self.epochs = merged
            await asyncio.to_thread(self.save_epochs, merged)
