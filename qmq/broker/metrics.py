"""The broker's Prometheus metrics (docs/broker.md lists them).

The counters bumped by every request (requests, errors, latency, stored messages) are plain numbers
read at scrape time: prometheus-client's counters take a lock per increment, which cost more than the
rest of a small send. The per-group gauges (backlog, in flight, retrying, dead) are set by `update`
from the broker's stats, which the broker process does every few seconds.
"""

from __future__ import annotations

import collections
from typing import Any

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily

from qmq.metrics import ReplicationMetrics, RequestMetrics, StoreMetrics, new_registry

REGISTRY = new_registry()
REQUESTS = RequestMetrics("qmq_broker", "broker", REGISTRY)
STORE = StoreMetrics("qmq_broker", "broker", REGISTRY)  # fsyncs: the server sets its `source`
BACKLOG = Gauge(
    "qmq_broker_backlog",
    "Messages not yet handed to any consumer of the group",
    ["subject", "group"],
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "qmq_broker_in_flight",
    "Messages handed out and not acknowledged",
    ["subject", "group"],
    registry=REGISTRY,
)
RETRYING = Gauge(
    "qmq_broker_retrying",
    "Messages waiting for a retry or in the retry subject",
    ["subject", "group"],
    registry=REGISTRY,
)
DEAD = Gauge("qmq_broker_dead", "Dead letters not re-driven", ["subject", "group"], registry=REGISTRY)
SUBJECT_MESSAGES = Gauge(
    "qmq_broker_subject_messages",
    "Messages ever stored in the subject",
    ["subject"],
    registry=REGISTRY,
)
SERVED_AHEAD = Counter(
    "qmq_broker_served_ahead",
    "Messages recorded for a consumer (prefetching, a worker) between its pulls, journalled with their send",
    registry=REGISTRY,
)
PULLS_WAITING = Gauge(
    "qmq_broker_pulls_waiting",
    "Pulls held open waiting for messages (long polls), by subject: about one per idle consumer",
    ["subject"],
    registry=REGISTRY,
)
_waiting_labels: set[str] = set()  # the subjects PULLS_WAITING has a series for
READ_ONLY = Gauge("qmq_broker_read_only", "1 while the broker group is read-only", registry=REGISTRY)
DAMAGED = Gauge(
    "qmq_broker_damaged_records",
    "Damaged message-log records found since start (background scrub and reads); readers skip them",
    registry=REGISTRY,
)


class StoredCounter:
    """Messages stored by sends, exported as `qmq_broker_messages_stored_total{subject}`."""

    def __init__(self) -> None:
        self.by_subject: collections.Counter[str] = collections.Counter()

    def collect(self):
        stored = CounterMetricFamily("qmq_broker_messages_stored", "Messages stored, by subject", labels=["subject"])
        for subject, count in list(self.by_subject.items()):
            stored.add_metric([subject], count)
        yield stored


STORED = StoredCounter()
REGISTRY.register(STORED)


def update(stats: dict[str, Any]) -> None:
    """Set the gauges from the broker's stats (`Administration.stats`)."""
    READ_ONLY.set(1 if stats["read_only"] else 0)
    DAMAGED.set(stats.get("damaged_records", 0))
    for subject, info in stats["subjects"].items():
        SUBJECT_MESSAGES.labels(subject).set(info["stored"])
    waiting = stats.get("pulls_waiting", {})
    for subject in _waiting_labels - waiting.keys():  # nobody waits on it any more: it drops out
        PULLS_WAITING.remove(subject)
    for subject, count in waiting.items():
        PULLS_WAITING.labels(subject).set(count)
    _waiting_labels.clear()
    _waiting_labels.update(waiting)
    for g in stats["groups"]:
        labels = (g["subject"], g["group"])
        BACKLOG.labels(*labels).set(g["backlog"])
        IN_FLIGHT.labels(*labels).set(g["in_flight"])
        RETRYING.labels(*labels).set(g["retrying"])
        DEAD.labels(*labels).set(g["dead"])


# ---- replication (docs/replication.md) ----------------------------------------------------------------

REPLICATION = ReplicationMetrics("qmq_broker", "broker", REGISTRY)
