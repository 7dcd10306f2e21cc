"""Flushing the message log to disk: group commit (`sync`) or every N ms (`async`).

With `sync`, a writer appends and then waits; one fdatasync covers every append that arrived while the
previous one ran, so throughput grows with the number of concurrent writers while each still learns
"durable" only after its bytes are on disk. With `async`, appends are acknowledged at once and a flush
runs every interval. An fsync failure is fatal for the store: the page cache may have dropped the
data, so every waiter gets the error and so does every later append (PostgreSQL's "fsyncgate" lesson).

The fsync thread here is Python. With `sync`, where qmq/store/_sync_thread.pyx is built, a store gets
the `NativeFlusher` of qmq/store/native_flush.py instead (its `new_flusher`): the same promises, with
a C thread that never takes the GIL (docs/benchmarks.md, an eighteenth machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum

from qmq.metrics import Histogram
from qmq.store.message_log import MessageLog
from qmq.store.recovery_point import RecoveryPoint

log = logging.getLogger("qmq.store")

DEFAULT_ASYNC_INTERVAL_MS = 500
# Under load, wait this long after the previous fsync so more appends share the next one (PostgreSQL's
# commit_delay). "Under load" means COMMIT_SIBLINGS or more flush requests arrived while the previous
# fsync ran (PostgreSQL's commit_siblings); otherwise (an idle store, a trickle of messages, or a
# send followed by its consumer's pull and ack) the flush starts at once, so they pay no delay.
DEFAULT_COMMIT_WINDOW_MS = 1.0
COMMIT_SIBLINGS = 4
# The time of each fsync, for `<server>_fsync_seconds` (qmq/metrics.py `StoreMetrics`).
FSYNC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class FlushMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


class FlushFailed(OSError):
    """The store could not make data durable; it accepts no more writes."""


class Flusher:
    """The thread that fsyncs the message log and tells waiters when their offset is durable.

    Blocking callers use `wait_durable`; asyncio callers `await durable(offset)`, which costs one
    cross-thread wake-up per flush round and loop, not one per waiter."""

    def __init__(
        self,
        message_log: MessageLog,
        mode: FlushMode = FlushMode.SYNC,
        interval_ms: int = DEFAULT_ASYNC_INTERVAL_MS,
        commit_window_ms: float = DEFAULT_COMMIT_WINDOW_MS,
        recovery_point: RecoveryPoint | None = None,
    ) -> None:
        """`recovery_point` is recorded after each successful fsync, before anyone learns of it."""
        self.message_log = message_log
        self.recovery_point = recovery_point
        self.mode = FlushMode(mode)
        self.interval_s = interval_ms / 1000
        self.commit_window_s = commit_window_ms / 1000
        self._durable = message_log.end_offset
        self.error: BaseException | None = None
        # fsync rounds so far, by the flusher thread and by `sync_now` on a caller's thread: two
        # counters, each only ever growing, as the metrics that read them must (qmq/metrics.py)
        self.syncs_by_thread = 0
        self.syncs_here = 0
        self.last_sync_s = 0.0  # how long the last fsync took
        self.sync_seconds = Histogram(FSYNC_BUCKETS_S)  # every fsync round's time
        self._sync_lock = threading.Lock()  # one fsync round (and its recovery point) at a time
        self._requested = 0  # highest offset someone waits for
        self._syncing = False
        self._arrivals = 0  # flush requests that came while the current fsync ran
        self._cond = threading.Condition()
        self._loops: dict[asyncio.AbstractEventLoop, _LoopWaiters] = {}
        self._stopping = False
        self._thread = self._start_thread()

    compiled = False  # whether the fsync thread is C (NativeFlusher)

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="qmq-flusher", daemon=True)
        thread.start()
        return thread

    @property
    def durable_offset(self) -> int:
        """Everything before it is fsynced."""
        return self._durable

    def request(self, offset: int) -> None:
        """Ask for a flush that covers `offset` (sync mode flushes at once; async at the next tick)."""
        if offset <= self.durable_offset:
            return
        with self._cond:
            if offset > self._requested:
                self._requested = offset
                self._arrivals += self._syncing
                self._cond.notify_all()

    @property
    def requested_offset(self) -> int:
        """The highest offset someone asked to be made durable (for tests)."""
        return self._requested

    @property
    def syncs(self) -> int:
        """fsync rounds so far, for benchmarks and tests."""
        return self.syncs_by_thread + self.syncs_here

    def sync_now(self) -> int:
        """Fsync on the calling thread, at once, and settle every waiter it covers; the durable end.
        For a caller with nothing else to do until its bytes are durable (a caught-up replica): it
        saves `request`'s hand-off to the flusher thread and the wake-up back. Raises `FlushFailed`
        when this fsync or an earlier one failed (the store is then read-only)."""
        self.check()
        end, error = self._sync()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._finish(end, error, loop)
        self.check()
        return self.durable_offset

    def wait_durable(self, offset: int, timeout: float | None = None) -> None:
        """Block until everything before `offset` is durable. Raises `FlushFailed` or `TimeoutError`."""
        self.request(offset)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.durable_offset < offset and self.error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"offset {offset} not durable within {timeout}s")
                self._cond.wait(remaining)
        self.check()

    async def durable(self, offset: int, *, linger_s: float = 0.0) -> None:
        """Await durability of everything before `offset` from an asyncio loop. `linger_s`: ask for
        no fsync of its own before that long; any fsync that starts meanwhile (another writer's)
        covers it. For what nobody waits on in the hot path (acks), so that it adds no fsync in
        series before a send's."""
        self.check()
        loop = asyncio.get_running_loop()
        waiters = self._waiters(loop, offset)
        if waiters is None:
            return
        future = loop.create_future()
        waiters.add(offset, future)
        if linger_s <= 0:
            self.request(offset)
            await future
            return
        later = loop.call_later(linger_s, self.request, offset)
        try:
            await future
        finally:
            later.cancel()

    def when_durable(self, offset: int, callback: Callable[[FlushFailed | None], None]) -> None:
        """Run `callback(None)` on the running loop once everything before `offset` is durable, or
        `callback(error)` once a flush failed; the flush is asked for at once. For a caller that
        settles many waiters itself (group commit): called from the loop's wake-up, one step sooner
        than a task awaiting `durable`."""
        loop = asyncio.get_running_loop()
        if self.error is not None:
            loop.call_soon(callback, FlushFailed(f"an earlier flush failed, the store is read-only: {self.error}"))
            return
        try:
            waiters = self._waiters(loop, offset)
        except FlushFailed as exc:  # a round failed while this loop registered
            loop.call_soon(callback, exc)
            return
        if waiters is None:
            loop.call_soon(callback, None)
            return
        waiters.add(offset, callback)
        self.request(offset)

    def _waiters(self, loop: asyncio.AbstractEventLoop, offset: int) -> _LoopWaiters | None:
        """The waiters of `loop`, registered on first use; None when `offset` is durable already."""
        if offset <= self.durable_offset:
            return None
        waiters = self._loops.get(loop)
        if waiters is None:
            waiters = self._new_waiters(loop)
            with self._cond:
                self._loops[loop] = waiters
            # A round that ended before this loop was registered woke nobody here: look again. One
            # that ends from now on wakes this loop, and its settle runs after the `add` that follows.
            self.check()
            if offset <= self.durable_offset:
                return None
        return waiters

    def _new_waiters(self, loop: asyncio.AbstractEventLoop) -> _LoopWaiters:
        """What registers `loop` to be woken after each round (on the loop's thread)."""
        return _LoopWaiters(loop)

    def _run(self) -> None:
        last_sync = 0.0
        while True:
            with self._cond:
                if self.mode is FlushMode.SYNC:
                    while self._requested <= self.durable_offset and not self._stopping:
                        self._cond.wait()
                elif not self._stopping:
                    self._cond.wait(self.interval_s)
                stopping = self._stopping
                busy = self._arrivals >= COMMIT_SIBLINGS
                self._arrivals, self._syncing = 0, True
            since_last = time.monotonic() - last_sync
            if self.mode is FlushMode.SYNC and busy and since_last < self.commit_window_s and not stopping:
                time.sleep(self.commit_window_s - since_last)
            end, error = self._sync()
            last_sync = time.monotonic()
            with self._cond:
                self._syncing = False
            self._finish(end, error, thread=True)
            if stopping or error is not None:
                return

    def _sync(self) -> tuple[int, BaseException | None]:
        """One fsync round: the end it covers, or the error it met (or an earlier round met: after a
        failed fsync no round runs, so nothing past it is ever said durable, nor recorded so)."""
        with self._sync_lock:
            if self.error is not None:  # a later fsync's success says nothing of what the failed one lost
                return 0, self.error
            started = time.monotonic()
            try:
                end = self.message_log.sync()
                self._record_point(end)
            except OSError as exc:
                log.critical("fsync of the message log failed, the store stops accepting writes: %s", exc)
                self.error = self.error or exc  # before the lock goes: no other round may fsync after it
                return 0, exc
            finally:
                self.last_sync_s = time.monotonic() - started
                self.sync_seconds.observe(self.last_sync_s)
        return end, None

    def _finish(
        self,
        end: int,
        error: BaseException | None,
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        thread: bool = False,
    ) -> None:
        """After a round (the flusher `thread`'s, or a caller's): move the durable end (or keep the
        error) and wake every waiter; those of `loop` (the caller's own) are settled here, the
        others through their loops."""
        with self._cond:
            if thread:
                self.syncs_by_thread += 1
            else:
                self.syncs_here += 1
            if error is None and self.error is None:  # a failed append taken back meanwhile (store.py) lowered the end
                self._durable = max(self._durable, min(end, self.message_log.end_offset))
            elif self.error is None:
                self.error = error
            self._cond.notify_all()
            loops = list(self._loops.values())
        for waiters in loops:
            if waiters.loop is loop:
                waiters.settle(self.durable_offset, self.error)
            elif waiters.loop.is_closed():
                with self._cond:
                    self._loops.pop(waiters.loop, None)
            else:
                waiters.wake(self.durable_offset, self.error)

    def forget_after(self, end: int) -> None:
        """The log was cut back to `end` (a failed append taken back): nothing past it is durable."""
        with self._cond:
            self._durable = min(self._durable, end)
            self._requested = min(self._requested, end)

    def check(self) -> None:
        """Raise if the store can no longer make writes durable."""
        if self.error is not None:
            raise FlushFailed(f"an earlier flush failed, the store is read-only: {self.error}")

    def close(self) -> None:
        """Flush what is left and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def _record_point(self, end: int) -> None:
        if self.recovery_point is None:
            return
        try:
            self.recovery_point.record(end)
        except OSError as exc:  # the point only stays lower: recovery is stricter about nothing
            log.warning("cannot record the durable recovery point: %s", exc)


Waiter = asyncio.Future | Callable[[FlushFailed | None], None]  # `durable`'s future, `when_durable`'s callback


class _LoopWaiters:
    """What one event loop waits on for durability (futures, callbacks), smallest offset first."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: list[tuple[int, int, Waiter]] = []  # a heap
        self._count = itertools.count()

    def add(self, offset: int, waiter: Waiter) -> None:
        heapq.heappush(self.pending, (offset, next(self._count), waiter))

    def wake(self, durable: int, error: BaseException | None) -> None:
        """Called on the flusher thread after each round."""
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self.loop.call_soon_threadsafe(self.settle, durable, error)

    def settle(self, durable: int, error: BaseException | None) -> None:
        pending = self.pending
        while pending and (error is not None or pending[0][0] <= durable):
            waiter = heapq.heappop(pending)[2]
            failed = None if error is None else FlushFailed(f"flush failed: {error}")
            if not isinstance(waiter, asyncio.Future):
                try:
                    waiter(failed)
                except BaseException:  # one waiter's bug must not strand the others
                    log.exception("a durability callback failed")
            elif waiter.done():
                continue
            elif failed is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(failed)
