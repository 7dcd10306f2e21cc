"""The flusher of `--flush sync` whose fsync thread is C (qmq/store/_sync_thread.pyx), where it is
built: `new_flusher` (below) picks it for a store.

Why: a Python flusher thread pays two GIL hand-offs on every message's path, one to start the fsync
(it waits for the event loop to let go of the GIL) and one to report it (the loop waits for the
thread's Python code): 0.15 ms of a 1.2 ms send-to-receipt on the seventeenth machine. The C thread
waits on a pthread condition, fsyncs, records the recovery point and wakes each event loop through an
eventfd the loop reads (`loop.add_reader`), all without the GIL. The loop then takes in what
happened (`_collect`): the durable end, the fsync times, a failure.

Promises, those of `Flusher`: nothing is said durable before an fsync covered it; after one fsync
failed no other runs (the C thread's rounds and a caller's `sync_now` share one lock and one failure),
and every waiter gets `FlushFailed`; the recovery point never exceeds what an fsync covered, also when
a failed append is taken back (`forget_after`: a request read before it is stale and ignored).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from qmq.compiled import load
from qmq.store.flush import (
    COMMIT_SIBLINGS,
    DEFAULT_ASYNC_INTERVAL_MS,
    DEFAULT_COMMIT_WINDOW_MS,
    Flusher,
    FlushFailed,
    FlushMode,
    _LoopWaiters,
)
from qmq.store.message_log import MessageLog
from qmq.store.recovery_point import RecoveryPoint

sync_thread = load("qmq.store._sync_thread")  # None: not built, or turned off (qmq/compiled.py)

log = logging.getLogger("qmq.store")

Collect = Callable[[], tuple[int, BaseException | None]]


class NativeFlusher(Flusher):
    compiled = True

    def _start_thread(self) -> threading.Thread:
        assert sync_thread is not None
        point_fd = -1 if self.recovery_point is None else self.recovery_point.open()
        self._point_errno = 0  # the last failure to record the recovery point, once logged
        self._native = sync_thread.SyncThread(self._durable, point_fd, self.commit_window_s, COMMIT_SIBLINGS)
        thread = threading.Thread(target=self._native.run, name="qmq-flusher", daemon=True)
        thread.start()
        return thread

    @property
    def durable_offset(self) -> int:
        return min(self._native.synced_end, self.message_log.end_offset)  # a failed append taken back: forget_after

    def request(self, offset: int) -> None:
        if offset <= self.durable_offset:
            return
        if offset > self._requested:
            self._requested = offset
        # The round covers all appended so far, as the Python thread's does. A failed append taken
        # back meanwhile (forget_after) makes this request stale: the C thread ignores it.
        epoch = self._native.epoch
        end, files = self.message_log.sync_files()
        self._native.ask(max(offset, end), files, epoch)

    def sync_now(self) -> int:
        self.check()
        epoch = self._native.epoch
        self._native.sync_here(*self.message_log.sync_files(), epoch)
        durable, error = self._collect()
        try:
            waiters = self._loops.get(asyncio.get_running_loop())
        except RuntimeError:
            waiters = None
        if waiters is not None:  # the others are woken through their eventfds
            waiters.settle(durable, error)
        self.check()
        return self.durable_offset

    def wait_durable(self, offset: int, timeout: float | None = None) -> None:
        self.request(offset)
        if not self._native.wait_synced(offset, -1.0 if timeout is None else timeout):
            if self._stopping:
                raise FlushFailed(f"the store was closed before offset {offset} was durable")
            raise TimeoutError(f"offset {offset} not durable within {timeout}s")
        self._collect()
        self.check()

    def forget_after(self, end: int) -> None:
        super().forget_after(end)
        self._native.lower_point(end)

    def check(self) -> None:
        if self.error is None and self._native.failed_errno:
            self._collect()
        super().check()

    def close(self) -> None:
        """Stop the thread, run the last round here, settle what it covers, let go of the loops."""
        with self._cond:
            self._stopping = True
        self._native.stop()
        self._thread.join()
        epoch = self._native.epoch
        self._native.sync_here(*self.message_log.sync_files(), epoch)
        durable, error = self._collect()
        self._native.shut()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        with self._cond:
            loops, self._loops = list(self._loops.values()), {}
        for waiters in loops:  # settled as the Python thread's last round does, then let go
            if waiters.loop is running:
                waiters.settle(durable, error)
            elif not waiters.loop.is_closed():
                waiters.wake(durable, error)
            assert isinstance(waiters, _EventfdWaiters)
            waiters.unlisten(self._native)

    def _new_waiters(self, loop: asyncio.AbstractEventLoop) -> _LoopWaiters:
        waiters = _EventfdWaiters(loop)
        waiters.listen(self._native, self._collect)
        return waiters

    def _observe_fsyncs(self, fsyncs: list[tuple[float, float]]) -> None:
        """The C thread's fsyncs since the last look: (start, seconds) each."""
        for _, seconds in fsyncs:
            self.sync_seconds.observe(seconds)
        if fsyncs:
            self.last_sync_s = fsyncs[-1][1]

    def _collect(self) -> tuple[int, BaseException | None]:
        """Take in what the C thread did since the last look (its rounds, their fsync times, a failed
        fsync); the durable end and the error, if any. Any thread."""
        synced, failed, rounds, here, durations, point_errno = self._native.collect()
        with self._cond:
            if failed and self.error is None:
                name = errno.errorcode.get(failed, str(failed))
                self.error = OSError(failed, f"{name} on fdatasync: {os.strerror(failed)}")
                log.critical("fsync of the message log failed, the store stops accepting writes: %s", self.error)
            self.syncs_by_thread, self.syncs_here = rounds - here, here
            self._observe_fsyncs(durations)
            if point_errno != self._point_errno:
                self._point_errno = point_errno
                if point_errno:
                    log.warning("cannot record the durable recovery point: %s", os.strerror(point_errno))
            closed = [w for w in self._loops.values() if w.loop.is_closed()]
            for waiters in closed:
                del self._loops[waiters.loop]
        for waiters in closed:
            assert isinstance(waiters, _EventfdWaiters)
            waiters.unlisten(self._native)
        self.message_log.synced_to(synced)
        return synced, self.error


class _EventfdWaiters(_LoopWaiters):
    """A loop's waiters, woken by the C thread through an eventfd the loop reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._efd = -1
        self._collect: Collect | None = None

    def listen(self, native: Any, collect: Collect) -> None:
        """Be woken after each round: on the loop's thread, once."""
        self._collect = collect
        efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.loop.add_reader(efd, self._woken)
        try:
            native.add_loop(efd)
        except BaseException:
            self.loop.remove_reader(efd)
            os.close(efd)
            raise
        self._efd = efd

    def unlisten(self, native: Any) -> None:
        """No more wake-ups: the C thread lets go of the eventfd at once, the loop (on its thread) and
        the descriptor after."""
        if self._efd < 0:
            return
        native.remove_loop(self._efd)
        efd, self._efd = self._efd, -1

        def close() -> None:
            with contextlib.suppress(Exception):  # the loop may be closing
                self.loop.remove_reader(efd)
            os.close(efd)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop or not self.loop.is_running():  # a loop not running runs no callback either
            close()
        else:
            try:
                self.loop.call_soon_threadsafe(close)
            except RuntimeError:  # closed meanwhile
                os.close(efd)

    def _woken(self) -> None:
        efd = self._efd
        if efd < 0:  # let go of meanwhile (unlisten): nothing comes through it any more
            return
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(efd)
        assert self._collect is not None
        durable, error = self._collect()
        self.settle(durable, error)


def new_flusher(
    message_log: MessageLog,
    mode: FlushMode = FlushMode.SYNC,
    interval_ms: int = DEFAULT_ASYNC_INTERVAL_MS,
    commit_window_ms: float = DEFAULT_COMMIT_WINDOW_MS,
    recovery_point: RecoveryPoint | None = None,
) -> Flusher:
    """The store's flusher: with `sync`, the one whose fsync thread is C where it is built (and the
    system has eventfd: Linux); else the Python one."""
    flusher = Flusher
    if FlushMode(mode) is FlushMode.SYNC and sync_thread is not None and hasattr(os, "eventfd"):
        flusher = NativeFlusher
    return flusher(message_log, mode, interval_ms, commit_window_ms, recovery_point)
