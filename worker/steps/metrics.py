"""The metrics step: times the steps and the handler, and counts how each delivery ended, in the
worker's metrics (worker/metrics.py). It runs in the worker, where messages are pulled and acked."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.outcome import Outcome
from worker.steps.step import Call, Next

if TYPE_CHECKING:
    from worker.metrics import WorkerMetrics


def metrics_step(metrics: WorkerMetrics) -> Callable[[Call, Next], Outcome]:
    def step(call: Call, call_next: Next) -> Outcome:
        bound = metrics.consumer(call.consumer.subject, call.consumer.group)
        started = time.perf_counter()
        outcome = call_next(call)
        bound.duration.observe(time.perf_counter() - started)
        bound.ended[outcome.kind].inc()
        return outcome

    return step
