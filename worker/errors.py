"""What a handler raises to say how a message should end, other than by returning.

`Retry(delay=...)` asks for the message again at a chosen time (through the broker's retry schedule,
counted against `max_retries`); `Reject(reason)` sends it to the group's dead letters at once. Any
other exception is a failure, retried with backoff (see worker/retry_policy.py).
"""

from __future__ import annotations


class Retry(Exception):
    """Deliver this message again after `delay` seconds (None: the consumer's backoff)."""

    def __init__(self, delay: float | None = None, reason: str = "retry requested") -> None:
        if delay is not None and not 0 <= delay < float("inf"):
            raise ValueError(f"delay must be a finite number of seconds >= 0, not {delay!r}")
        super().__init__(reason)
        self.delay = delay
        self.reason = reason


class Reject(Exception):
    """Dead-letter this message now: retrying cannot help (bad data, an order that no longer exists)."""

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason


class TimeLimitExceeded(Exception):
    """Raised inside a handler that ran longer than its consumer's `time_limit`; a failure like any other."""


class WorkerLost(Exception):
    """The pool process running a handler died (killed, out of memory, a crash in C code)."""
