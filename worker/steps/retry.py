"""The retry step: any exception from the steps inside it (and the handler) becomes an outcome, as
the consumer's retry policy decides (worker/retry_policy.py): a retry after a backoff, or a dead letter."""

from __future__ import annotations

from worker.outcome import Outcome
from worker.steps.step import Call, Next


def retry_step(call: Call, call_next: Next) -> Outcome:
    """Any exception from the steps inside becomes the consumer's retry policy's outcome."""
    try:
        return call_next(call)
    except Exception as exc:
        return call.consumer.retry.decide(exc, call.message.attempts)
