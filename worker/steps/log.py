"""The logging step: one line per message worth knowing about (logger `qmq.worker`).

A retry is a WARNING with the reason and the delay, a dead letter an ERROR (with the traceback where
the handler ran in this process), a deliberate `qmq.Reject` one WARNING line (the handler decided:
nothing went wrong), a skipped duplicate INFO, a success DEBUG (a busy worker handles thousands a
second).
"""

from __future__ import annotations

import logging

from worker.outcome import Kind, Outcome
from worker.steps.step import Call, Next

log = logging.getLogger("qmq.worker")


def logging_step(call: Call, call_next: Next) -> Outcome:
    outcome = call_next(call)
    kind, message = outcome.kind, call.message
    if kind is Kind.ACK:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s attempt %d: done", call.consumer.name, message.id, message.attempts)
    elif kind is Kind.RETRY:
        log.warning(
            "%s %s attempt %d failed, retrying in %.1f s: %s",
            call.consumer.name,
            message.id,
            message.attempts,
            outcome.delay_s,
            outcome.reason,
        )
    elif kind is Kind.DEAD and outcome.rejected:
        log.warning(
            "%s %s attempt %d rejected, dead-lettered: %s",
            call.consumer.name,
            message.id,
            message.attempts,
            outcome.reason,
        )
    elif kind is Kind.DEAD:
        log.error(
            "%s %s attempt %d dead-lettered: %s",
            call.consumer.name,
            message.id,
            message.attempts,
            outcome.reason,
            exc_info=outcome.error,
        )
    else:
        log.info("%s %s attempt %d: already consumed, skipped", call.consumer.name, message.id, message.attempts)
    return outcome
