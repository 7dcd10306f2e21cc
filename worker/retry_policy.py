"""A consumer's retry policy: what a handler raised becomes an outcome (the retry step,
worker/steps/retry.py, applies it), and the backoff between attempts.

- `Reject(reason)`: dead-lettered at once.
- `Retry(delay)`: delivered again after `delay` (the consumer's backoff when None).
- any other exception matching `autoretry_for` and not `dont_autoretry_for`: retried with
  exponential backoff, `retry_backoff` seconds doubling up to `retry_backoff_max`; with
  `retry_jitter` each delay is drawn uniformly from [delay / 2, delay], so that a crowd of failures
  does not come back at the same instant, and never at once.
- an exception outside `autoretry_for`, or any failure once `max_retries` retries were made:
  dead-lettered, with the error as the reason.

The message's retries go through the broker (`%RETRY%subject%group`); nothing waits in the worker.
"""

from __future__ import annotations

import random
import traceback
from dataclasses import dataclass

from worker.errors import Reject, Retry
from worker.outcome import Kind, Outcome

DEFAULT_MAX_RETRIES = 32
DEFAULT_BACKOFF_S = 5.0
DEFAULT_BACKOFF_MAX_S = 3600.0
FOREVER_ATTEMPTS = 1_000_000  # the most the broker takes as max_attempts: max_retries=None
MAX_REASON_CHARS = 1000  # the broker keeps this much of a reason


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int | None = DEFAULT_MAX_RETRIES
    backoff_s: float = DEFAULT_BACKOFF_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    jitter: bool = True
    autoretry_for: tuple[type[BaseException], ...] = (Exception,)
    dont_autoretry_for: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError("max_retries must be >= 0 or None (retry forever)")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError("retry_backoff must be >= 0 and at most retry_backoff_max")

    @property
    def max_attempts(self) -> int:
        """Deliveries in all, as the broker counts them: the first plus the retries."""
        return FOREVER_ATTEMPTS if self.max_retries is None else self.max_retries + 1

    def exhausted(self, attempts: int) -> bool:
        return self.max_retries is not None and attempts > self.max_retries

    def backoff(self, attempts: int, rng: random.Random | None = None) -> float:
        """The delay before the next delivery of a message whose `attempts`-th delivery failed."""
        delay = min(self.backoff_max_s, self.backoff_s * 2 ** min(attempts - 1, 64))
        if self.jitter:
            delay = (rng or random).uniform(delay / 2, delay)
        return delay

    def decide(self, exc: BaseException, attempts: int) -> Outcome:
        """The outcome of a delivery (its `attempts`-th) that raised `exc`."""
        reason = describe(exc)
        if isinstance(exc, Reject):
            return Outcome(Kind.DEAD, reason=reason, error=exc, rejected=True)
        if not isinstance(exc, Retry) and (
            not isinstance(exc, self.autoretry_for) or isinstance(exc, self.dont_autoretry_for)
        ):
            return Outcome(Kind.DEAD, reason=f"not retried: {reason}", error=exc)
        if self.exhausted(attempts):
            return Outcome(Kind.DEAD, reason=f"gave up after {attempts} attempts: {reason}", error=exc)
        delay = exc.delay if isinstance(exc, Retry) and exc.delay is not None else self.backoff(attempts)
        return Outcome(Kind.RETRY, delay_s=delay, reason=reason, error=exc)


def describe(exc: BaseException) -> str:
    """`Type: message (at file:line in function)`, the last frame of the traceback, to fit a dead letter."""
    text = exc.reason if isinstance(exc, Reject | Retry) else f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    if frames and not isinstance(exc, Reject | Retry):
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text[:MAX_REASON_CHARS]
