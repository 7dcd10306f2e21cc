"""Flushing the message log to disk: group commit (`sync`) or every N ms (`async`).

With `sync`, a writer appends and then waits; one fdatasync covers every append that arrived while the
previous one ran, so throughput grows with the number of concurrent writers while each still learns
"durable" only after its bytes are on disk. With `async`, appends are acknowledged at once and a flush
runs every interval. An fsync failure is fatal for the store: the page cache may have dropped the
data, so every waiter gets the error and so does every later append (PostgreSQL's "fsyncgate" lesson).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from enum import StrEnum

from qmq.store.message_log import MessageLog

log = logging.getLogger("qmq.store")

DEFAULT_ASYNC_INTERVAL_MS = 500

Callback = Callable[[BaseException | None], None]


class FlushMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


class FlushFailed(OSError):
    """The store could not make data durable; it accepts no more writes."""


class Flusher:
    """The thread that fsyncs the message log and tells waiters when their offset is durable."""

    def __init__(self, message_log: MessageLog, mode: FlushMode = FlushMode.SYNC,
                 interval_ms: int = DEFAULT_ASYNC_INTERVAL_MS) -> None:
        self.message_log = message_log
        self.mode = FlushMode(mode)
        self.interval_s = interval_ms / 1000
        self.durable_offset = message_log.end_offset
        self.error: BaseException | None = None
        self.syncs = 0  # fsync rounds so far, for metrics and benchmarks
        self._waiters: list[tuple[int, Callback]] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="qmq-flusher", daemon=True)
        self._thread.start()

    def when_durable(self, offset: int, callback: Callback) -> None:
        """Call `callback(None)` once everything before `offset` is durable, or `callback(error)` if
        that can no longer happen. The callback runs on the flusher thread: keep it short."""
        with self._cond:
            if self.error is None and offset > self.durable_offset:
                self._waiters.append((offset, callback))
                self._cond.notify()
                return
            error = self.error
        callback(error)

    def wait_durable(self, offset: int, timeout: float | None = None) -> None:
        """Block until everything before `offset` is durable. Raises `FlushFailed` or `TimeoutError`."""
        done = threading.Event()
        result: list[BaseException | None] = []

        def settle(error: BaseException | None) -> None:
            result.append(error)
            done.set()

        self.when_durable(offset, settle)
        if not done.wait(timeout):
            raise TimeoutError(f"offset {offset} not durable within {timeout}s")
        if result[0] is not None:
            raise FlushFailed(f"flush failed: {result[0]}") from result[0]

    async def durable(self, offset: int) -> None:
        """Await durability of everything before `offset` from an asyncio loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(error: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle_future, future, error)

        self.when_durable(offset, settle)
        await future

    def _run(self) -> None:
        while True:
            with self._cond:
                if self.mode is FlushMode.SYNC:
                    while not self._waiters and not self._stopping:
                        self._cond.wait()
                elif not self._stopping:
                    self._cond.wait(self.interval_s)
                waiters, self._waiters = self._waiters, []
                stopping = self._stopping
            try:
                end = self.message_log.sync()
                error = None
            except OSError as exc:
                log.critical("fsync of the message log failed, the store stops accepting writes: %s", exc)
                error = exc
            with self._cond:
                self.syncs += 1
                if error is None:
                    self.durable_offset = max(self.durable_offset, end)
                else:
                    self.error = error
                    waiters.extend(self._waiters)
                    self._waiters = []
            for offset, callback in waiters:
                if error is None and offset > end:
                    self.when_durable(offset, callback)  # appended after our snapshot: next round
                else:
                    callback(error)
            if stopping or error is not None:
                return

    def check(self) -> None:
        """Raise if the store can no longer make writes durable."""
        if self.error is not None:
            raise FlushFailed(f"an earlier flush failed, the store is read-only: {self.error}")

    def close(self) -> None:
        """Flush what is left and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()


def _settle_future(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(FlushFailed(f"flush failed: {error}"))
