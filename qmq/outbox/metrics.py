"""The relay's Prometheus metrics, in its own registry (served on `qmq relay --metrics-port`), one
series per outbox database (label `database`, its URL without password)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from qmq.metrics import new_registry

REGISTRY = new_registry()
LABELS = ["database"]

SHIPPED = Counter("qmq_relay_shipped", "Outbox rows shipped and marked sent", LABELS, registry=REGISTRY)
SEND_FAILED = Counter(
    "qmq_relay_send_failed", "Outbox rows a send failed for (retried after a backoff)", LABELS, registry=REGISTRY
)
LEASE_LOST = Counter(
    "qmq_relay_lease_lost", "Rows shipped after their lease expired (possible duplicates)", LABELS, registry=REGISTRY
)
DB_ERRORS = Counter(
    "qmq_relay_database_errors", "Database errors (the relay waits and reconnects)", LABELS, registry=REGISTRY
)
PURGED = Counter("qmq_relay_purged", "Sent rows deleted after the audit window", LABELS, registry=REGISTRY)
FLAGGED = Counter(
    "qmq_relay_flagged", "Rows flagged as pending too long or failing too often", LABELS, registry=REGISTRY
)
PENDING = Gauge("qmq_relay_pending_rows", "Pending outbox rows", LABELS, registry=REGISTRY)
OLDEST_PENDING = Gauge("qmq_relay_oldest_pending_seconds", "Age of the oldest pending row", LABELS, registry=REGISTRY)
FLAGGED_PENDING = Gauge("qmq_relay_flagged_pending_rows", "Pending rows that are flagged", LABELS, registry=REGISTRY)
BATCH_SECONDS = Histogram(
    "qmq_relay_batch_seconds",
    "Time to claim, ship and mark one batch",
    LABELS,
    registry=REGISTRY,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
