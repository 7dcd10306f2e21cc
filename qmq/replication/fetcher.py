"""A replica's fetcher: copies its group master's message log into the local store, record for
record, CRC-checked, and tells the master how far it has it durable (docs/replication.md).

It long-polls REPL_FETCH from its log end (`offset`); each request's `durable` is the local durable
end, which is the master's acknowledgement. Two tasks share one connection:

- the fetch loop writes each chunk; caught up, it asks for the next one once that chunk is durable,
  so one request per fsync both acknowledges and fetches, and the next reply carries whatever the
  master appended during the fsync (measured: fewer, bigger chunks, and less CPU on both sides than
  overlapping the fetch with the fsync, docs/benchmarks.md). Caught up, it also runs that fsync
  itself, on the event loop, which has nothing else to do until the chunk is durable: no hand-off to
  the flusher thread and back, which cost a fifth of the replicated acknowledgement on a VM; only
  while fsyncs take under `INLINE_SYNC_MAX_S`, so a slow disk never holds the loop for long. Far
  behind (a new or wiped replica), it asks for bigger chunks and for the next one while the
  flusher thread's fsync of the last one runs;
- the sync loop waits for each fsync and runs `on_durable(end)`; when a fetch is out meanwhile, it
  tells the master the durable offset at once with a one-way fetch of `max_bytes` 0.

Only a master whose reply says `pipelined` reads `durable`; until one has (an older master takes
`offset` as the acknowledgement), the fetch loop waits for its fsync before each fetch. A master
that says it is not master, or that this replica's log runs past its own, is reported to the server
(`on_trouble`), which asks the meta server again and truncates if it must. `on_durable(end)` runs
after each fsync, before the master hears of it: what the server derives from the log beyond the
store's own files (a delay server's buckets) keeps up with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.store import epochs as ep
from qmq.store.replication import CATCH_UP_CHUNK_BYTES, DEFAULT_CHUNK_BYTES, ChunkError
from qmq.store.store import LogStore, StoreError

log = logging.getLogger("qmq.replica")

FETCH_WAIT_MS = 500  # a fetch waits this long for new records before answering empty
RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)  # between failed fetches, the last repeated
REPLY_GRACE_S = 10.0  # a fetch's reply may come this long after its wait
# Smaller chunks are written on the event loop: a thread would hold the GIL for most of the write
# (checking records is Python) and keep the loop, and so the next report, waiting for it.
INLINE_APPEND_BYTES = 1024 * 1024
MAX_UNSYNCED_BYTES = 2 * CATCH_UP_CHUNK_BYTES  # the fetch loop waits while this much is written, not durable
INLINE_SYNC_MAX_S = 0.005  # a caught-up replica fsyncs on its loop while the last fsync took less than this


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
        self.master_replicated_upto: int | None = None  # every replica holds the log below it, said the master
        self.damaged_at: int | None = None  # a record of the master's that failed its CRC here: told in the next fetch
        self.fetches = 0
        self.unreachable = False  # the last fetch could not reach the master (told to the meta server)
        # Durable here, and `on_durable` ran up to it. A fetcher before this one may have stopped
        # between an fsync and its `on_durable`: with one, nothing is taken as done, and the sync loop
        # runs it up to the log end before the first fetch reports anything.
        self.durable = store.durable_offset if on_durable is None else 0
        self.reported = -1  # the highest `durable` sent to the master on this connection
        self.pipelined = False  # this connection's master reads `durable` (it said so in a reply)
        self._polling = False  # a fetch is out, waiting for its reply
        self._written = asyncio.Event()  # the fetch loop wrote a chunk
        self._synced = asyncio.Event()  # the sync loop moved `durable`
        self._sync_error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._threads: set[asyncio.Future[Any]] = set()  # work on threads, which a cancel does not stop
        self._conn: AsyncConnection | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="qmq-replica-fetcher")
        self._sync_task = asyncio.create_task(self._sync_loop(), name="qmq-replica-sync")

    async def stop(self) -> None:
        """Stop fetching; returns once nothing more is written: a chunk being written on a thread is
        waited for (a promoted replica's log and epochs must not change under the new master)."""
        for task in (self._task, self._sync_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for work in list(self._threads):
            with contextlib.suppress(Exception):
                await work
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    # ---- the sync loop ----------------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        """Wait for the fsync of what the fetch loop wrote, run `on_durable`, tell the master."""
        while True:
            end = self.store.end_offset
            if end <= self.durable:
                self._written.clear()
                await self._written.wait()
                continue
            try:
                await self.store.flushed(end)
                if self.on_durable is not None:
                    await self.on_durable(end)
            except Exception as exc:  # the store failed: the fetch loop raises it, and retries
                if self._sync_error is None:
                    log.error("the replicated log is not durable: %s", exc)
                self._sync_error = exc
                self._synced.set()
                await asyncio.sleep(RETRY_BACKOFF_S[-1])
                continue
            self._sync_error = None
            self.durable = max(self.durable, end)
            self._synced.set()
            await self._report()

    async def _report(self) -> None:
        """Tell the master the durable offset now, while the fetch loop waits for its reply (when it
        does not, its next fetch says it)."""
        conn = self._conn
        if not (self.pipelined and self._polling) or conn is None or conn.closed or self.durable <= self.reported:
            return
        self.reported = self.durable
        body = {**self._body(self.durable), "durable": self.durable, "max_bytes": 0, "wait_ms": 0}
        try:
            await conn.send_oneway(RequestCode.REPL_FETCH, body)
        except (OSError, ConnectionError) as exc:  # the fetch loop meets it too, and reconnects
            log.debug("cannot report the durable offset to %s: %s", self.master, exc)

    async def _append_durable(self, data: bytes, offset: int) -> None:
        """Write a chunk and fsync it on this loop, then run `on_durable`: the sync loop has nothing
        to do for it, and the next fetch reports it."""
        end = self.store.append_replicated(data, offset, sync_now=True)
        if self.on_durable is not None:
            try:
                await self.on_durable(end)
            except Exception:
                log.exception("after the chunk at %d was durable; the sync loop tries again", offset)
                self._written.set()
                return
        self.durable = max(self.durable, end)
        self._synced.set()

    async def _until_durable(self, offset: int) -> None:
        """Wait until everything before `offset` is durable here (and `on_durable` ran)."""
        while self.durable < offset:
            if self._sync_error is not None:
                raise StoreError(f"the replicated log is not durable: {self._sync_error}")
            self._synced.clear()
            self._written.set()
            await self._synced.wait()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._fetch_once()
                if failures:
                    log.info("fetching from master %s again", self.master)
                failures = 0
                self.unreachable = False
                continue
            except RemoteError as exc:
                self.unreachable = False  # it answered
                if failures == 0:
                    log.warning("master %s refused a fetch: %s", self.master, exc)
                if exc.code in (ErrorCode.NOT_MASTER, ErrorCode.BAD_REQUEST):
                    self.on_trouble(exc)
            except (OSError, ConnectionError, TimeoutError) as exc:
                if failures == 0:
                    log.warning("cannot fetch from master %s: %s", self.master, exc)
                await self._drop_connection()
                self.unreachable = True
                self.on_unreachable()  # the meta server may have promoted someone: ask it now
            except StoreError as exc:  # read-only (out of space, a failed fsync): nothing to copy into
                if failures == 0:
                    log.error("cannot copy the master's log into the store: %s", exc)
            except ChunkError as exc:
                log.error("master %s sent a chunk that fails its checks, fetching it again: %s", self.master, exc)
                self.damaged_at = exc.offset  # the master mends its copy, or cuts it out (mending.py)
            except Exception as exc:  # a reply it cannot read, a bug: replication must not end until a restart
                if failures == 0:
                    log.exception("fetching from master %s failed; trying again on a new connection", self.master)
                else:
                    log.debug("fetching from master %s failed again: %r", self.master, exc)
                await self._drop_connection()
            failures += 1
            await asyncio.sleep(RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1])

    async def _drop_connection(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a thread, which `stop` waits for: cancelling this await would not stop it."""
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._threads.add(work)
        work.add_done_callback(self._threads.discard)
        return await asyncio.shield(work)

    def _body(self, offset: int) -> dict[str, Any]:
        return {"group": self.group, "replica": self.address, "epoch": self.epoch, "offset": offset}

    async def _fetch_once(self) -> None:
        if self._conn is None or self._conn.closed:
            host, port = split_address(self.master)
            self.pipelined, self.reported = False, -1  # until this master's reply says it reads `durable`
            self._conn = await AsyncConnection.open(host, port, token=self.token, client_id=f"replica-{self.address}")
        offset = self.store.end_offset
        behind = self.master_end - offset > DEFAULT_CHUNK_BYTES
        if not (self.pipelined and behind):  # caught up, or the offset is the acknowledgement: durable first
            await self._until_durable(offset)
        elif offset - self.durable > MAX_UNSYNCED_BYTES:  # the disk is behind: let it catch up
            await self._until_durable(offset - MAX_UNSYNCED_BYTES)
        body = self._body(offset)
        body["durable"] = durable = self.durable
        body["max_bytes"] = CATCH_UP_CHUNK_BYTES if behind else DEFAULT_CHUNK_BYTES
        body["wait_ms"] = 0 if behind else self.wait_ms
        if self.damaged_at is not None:
            body["damaged_at"] = self.damaged_at
        self.reported = max(self.reported, durable)
        self._polling = True  # from here the sync loop reports a newer durable offset itself
        try:
            reply = await self._conn.request(RequestCode.REPL_FETCH, body, timeout=self.wait_ms / 1000 + REPLY_GRACE_S)
        finally:
            self._polling = False
        self.fetches += 1
        self.unreachable = False  # whatever comes of the reply, the master answered
        self.pipelined = reply.get("pipelined") is True
        data = reply.get("data") or b""
        self.master_end = int(reply.get("end", 0))
        replicated = reply.get("replicated")  # an older master does not say
        if isinstance(replicated, int) and not isinstance(replicated, bool):
            self.master_replicated_upto = replicated
        if data:
            small = len(data) <= INLINE_APPEND_BYTES  # a few writes: cheaper than a thread hop
            if small and not behind and self.store.flusher.last_sync_s < INLINE_SYNC_MAX_S:
                await self._append_durable(data, offset)
            elif small:
                self.store.append_replicated(data, offset)
                self._written.set()
            else:
                await self._in_thread(self.store.append_replicated, data, offset)
                self._written.set()
            self.damaged_at = None
        masters = [(int(e), int(s)) for e, s in reply.get("epochs") or ()]
        merged = ep.merged(self.epochs, masters, self.store.end_offset)
        if merged != self.epochs:
            try:
                await self._in_thread(self.save_epochs, merged)
            except OSError as exc:  # a local disk's trouble, not the master's being out of reach
                raise StoreError(f"cannot save the epochs file: {exc}") from exc
            self.epochs = merged
