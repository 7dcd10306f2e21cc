"""The chain of steps (worker/steps/) a message goes through, assembled once per consumer.

Outer steps run where the worker pulls and acknowledges (logging, metrics); inner steps run where
the handler runs: in the same thread with `-P threads` and `-P solo`, in a pool process with
`-P processes` (hooks, retry, the app's steps, Redis idempotency, the transaction, SQL idempotency,
the time limit, then the handler).
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.consumer import Consumer
from worker.outcome import ACKED, Outcome
from worker.steps.hooks import hooks_step
from worker.steps.idempotency import redis_idempotency_step, sql_idempotency_step
from worker.steps.log import logging_step
from worker.steps.retry import retry_step
from worker.steps.step import Call, Next, Step, chain
from worker.steps.time_limit import time_limit_step
from worker.steps.transaction import transaction_step


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
