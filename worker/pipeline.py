"""The chain of steps a message goes through, assembled once per consumer.

Outer steps run where the worker pulls and acknowledges (logging, metrics); inner steps run where
the handler runs: in the same thread with `-P threads` and `-P solo`, in a pool process with
`-P processes` (hooks, retry, the app's steps, Redis idempotency, the transaction, SQL idempotency,
the time limit, then the handler).
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.app import Consumer
from worker.hooks import hooks_step
from worker.idempotency import redis_idempotency_step, sql_idempotency_step
from worker.log_step import logging_step
from worker.middleware import Call, Next, Step, chain
from worker.outcome import ACKED, Outcome
from worker.retry import retry_step
from worker.time_limit import time_limit_step
from worker.transaction import transaction_step


def run_handler(call: Call) -> Outcome:
    call.consumer.call_handler(call.message, call.session)
    return ACKED


def inner_chain(consumer: Consumer) -> Next:
    steps: list[Step] = [
        hooks_step,
        retry_step,
        *consumer.app.steps,
        redis_idempotency_step,
        transaction_step,
        sql_idempotency_step,
        time_limit_step,
    ]
    return chain(steps, run_handler)


def outer_chain(steps: Sequence[Step], inner: Next) -> Next:
    return chain([logging_step, *steps], inner)
