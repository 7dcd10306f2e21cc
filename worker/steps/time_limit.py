"""The time limit step: a handler running longer than its consumer's `time_limit` gets
`TimeLimitExceeded` raised inside it (as Dramatiq does), which fails the message like any other
exception: its transaction rolls back and it is retried.

The exception is delivered to the handler's thread by the interpreter at the next Python
instruction, so a handler blocked in one long C call (a socket read without a timeout) sees it only
when that call returns: give network calls their own timeouts. The limit covers the handler only,
never the commit that follows it, so a commit is never cut in half.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import threading
import time

from worker.errors import TimeLimitExceeded
from worker.outcome import Outcome
from worker.steps.step import Call, Next

log = logging.getLogger("qmq.worker")


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class Watchdog:
    """One thread that raises `TimeLimitExceeded` in handler threads past their deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int]] = []  # (deadline, token)
        self._armed: dict[int, tuple[int, bool]] = {}  # token -> (thread id, fired)
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> int:
        """Watch the calling thread for `seconds`; returns the token to `disarm` with."""
        with self._lock:
            token = next(self._tokens)
            self._armed[token] = (threading.get_ident(), False)
            heapq.heappush(self._heap, (time.monotonic() + seconds, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="qmq-time-limit", daemon=True)
                self._thread.start()
            self._wake.notify()
        return token

    def disarm(self, token: int) -> bool:
        """Stop watching; True if the limit fired. An exception fired and not yet raised is withdrawn,
        so none can escape into the code after the handler."""
        with self._lock:
            thread_id, fired = self._armed.pop(token)
            if fired:
                _set_async_exc(thread_id, None)
            return fired

    def _run(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._heap and (self._heap[0][1] not in self._armed or self._heap[0][0] <= now):
                    _, token = heapq.heappop(self._heap)
                    if token in self._armed:
                        thread_id, _ = self._armed[token]
                        self._armed[token] = (thread_id, True)
                        _set_async_exc(thread_id, TimeLimitExceeded)
                timeout = self._heap[0][0] - now if self._heap else None
                self._wake.wait(timeout)


WATCHDOG = Watchdog()  # one per process: the pool threads, or a pool process's handler thread


def time_limit_step(call: Call, call_next: Next) -> Outcome:
    limit = call.consumer.time_limit
    if limit is None:
        return call_next(call)
    token = WATCHDOG.arm(limit)
    try:
        return call_next(call)
    except TimeLimitExceeded:
        raise TimeLimitExceeded(f"{call.consumer.name} ran longer than its time limit of {limit} s") from None
    finally:
        WATCHDOG.disarm(token)
