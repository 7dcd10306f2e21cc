"""The broker's Prometheus metrics (docs/broker.md lists them).

Counters move as requests are handled; the per-group gauges (backlog, in flight, retrying, dead) are
set from `BrokerService.stats()` by `update`, which the broker calls every few seconds.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from qmq.metrics import new_registry

if TYPE_CHECKING:
    from qmq.broker.service import BrokerService

REGISTRY = new_registry()
REQUESTS = Counter("qmq_broker_requests_total", "Requests handled by the broker", ["request"], registry=REGISTRY)
ERRORS = Counter(
    "qmq_broker_request_errors_total", "Requests answered with an error frame", ["request", "error"],
    registry=REGISTRY,
)
STORED = Counter("qmq_broker_messages_stored_total", "Messages stored, by subject", ["subject"], registry=REGISTRY)
BACKLOG = Gauge(
    "qmq_broker_backlog", "Messages not yet handed to any consumer of the group", ["subject", "group"],
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "qmq_broker_in_flight", "Messages handed out and not acknowledged", ["subject", "group"],
    registry=REGISTRY,
)
RETRYING = Gauge(
    "qmq_broker_retrying", "Messages waiting for a retry or in the retry subject", ["subject", "group"],
    registry=REGISTRY,
)
DEAD = Gauge("qmq_broker_dead", "Dead letters not re-driven", ["subject", "group"], registry=REGISTRY)
SUBJECT_MESSAGES = Gauge(
    "qmq_broker_subject_messages", "Messages ever stored in the subject", ["subject"],
    registry=REGISTRY,
)
READ_ONLY = Gauge("qmq_broker_read_only", "1 while the broker group is read-only", registry=REGISTRY)


@functools.cache
def stored(subject: str):
    """The labelled counter for `subject` (cached: labels() costs a lock and a lookup per call)."""
    return STORED.labels(subject)


@functools.cache
def request(name: str):
    return REQUESTS.labels(name)


def update(service: BrokerService) -> None:
    stats = service.stats()
    READ_ONLY.set(1 if stats["read_only"] else 0)
    for subject, info in stats["subjects"].items():
        SUBJECT_MESSAGES.labels(subject).set(info["stored"])
    for g in stats["groups"]:
        labels = (g["subject"], g["group"])
        BACKLOG.labels(*labels).set(g["backlog"])
        IN_FLIGHT.labels(*labels).set(g["in_flight"])
        RETRYING.labels(*labels).set(g["retrying"])
        DEAD.labels(*labels).set(g["dead"])
