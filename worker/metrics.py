"""The worker's Prometheus metrics, in its own registry (served with /healthz on `--metrics-port`,
worker/http.py); the metrics step (worker/steps/metrics.py) times handlers and counts how messages end.

| metric | type | labels |
|---|---|---|
| `qmq_worker_messages_received_total` | counter | subject, group |
| `qmq_worker_messages_succeeded_total` | counter | subject, group |
| `qmq_worker_messages_duplicate_total` (skipped by idempotency, acked) | counter | subject, group |
| `qmq_worker_messages_retried_total` | counter | subject, group |
| `qmq_worker_messages_dead_lettered_total` | counter | subject, group |
| `qmq_worker_messages_in_flight` (received, not yet acked or nacked) | gauge | subject, group |
| `qmq_worker_handler_duration_seconds` | histogram | subject, group |
| `qmq_worker_healthy` (1 or 0, see worker/liveness.py) | gauge | |
| `qmq_worker_last_progress_timestamp_seconds` | gauge | |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qmq.metrics import new_registry
from worker.outcome import Kind

DURATION_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
LABELS = ("subject", "group")


class ConsumerMetrics:
    """The metrics of one consumer, with their labels bound once (looking labels up costs per message)."""

    def __init__(self, metrics: WorkerMetrics, subject: str, group: str) -> None:
        self.received = metrics.received.labels(subject, group)
        self.in_flight = metrics.in_flight.labels(subject, group)
        self.duration = metrics.duration.labels(subject, group)
        self.ended = {
            Kind.ACK: metrics.succeeded.labels(subject, group),
            Kind.DUPLICATE: metrics.duplicate.labels(subject, group),
            Kind.RETRY: metrics.retried.labels(subject, group),
            Kind.DEAD: metrics.dead.labels(subject, group),
        }


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self.received = Counter("qmq_worker_messages_received", "Messages pulled", LABELS, registry=r)
        self.succeeded = Counter("qmq_worker_messages_succeeded", "Messages handled and acked", LABELS, registry=r)
        self.duplicate = Counter(
            "qmq_worker_messages_duplicate", "Deliveries skipped by idempotency", LABELS, registry=r
        )
        self.retried = Counter(
            "qmq_worker_messages_retried", "Deliveries that failed and will come again", LABELS, registry=r
        )
        self.dead = Counter(
            "qmq_worker_messages_dead_lettered", "Messages sent to the dead letters", LABELS, registry=r
        )
        self.in_flight = Gauge("qmq_worker_messages_in_flight", "Received, not yet acked or nacked", LABELS, registry=r)
        self.duration = Histogram(
            "qmq_worker_handler_duration_seconds",
            "Time in the steps and the handler",
            LABELS,
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.healthy = Gauge("qmq_worker_healthy", "1 while the worker is live (see /healthz)", registry=r)
        self.last_progress = Gauge(
            "qmq_worker_last_progress_timestamp_seconds",
            "When the worker last finished a message or found nothing to do",
            registry=r,
        )
        self.healthy.set(1)
        self._consumers: dict[str, ConsumerMetrics] = {}

    def consumer(self, subject: str, group: str) -> ConsumerMetrics:
        key = f"{subject}\0{group}"
        found = self._consumers.get(key)
        if found is None:
            found = self._consumers[key] = ConsumerMetrics(self, subject, group)
        return found
