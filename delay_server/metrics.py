"""The delay server's Prometheus metrics (docs/delay.md lists them).

Counters of the hot paths are plain numbers read at scrape time: the requests' (`REQUESTS`), and the
scheduler's counters and lateness histogram, read from the scheduler (prometheus-client takes a lock
per observation). `qmq_delay_pending{bucket}` is refreshed from the scheduler every few seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from qmq.metrics import ReplicationMetrics, RequestMetrics, StoreMetrics, new_registry

if TYPE_CHECKING:
    from delay_server.scheduler import Scheduler

REGISTRY = new_registry()
REQUESTS = RequestMetrics("qmq_delay", "delay server", REGISTRY)
REPLICATION = ReplicationMetrics("qmq_delay", "delay server", REGISTRY)  # docs/replication.md
STORE = StoreMetrics("qmq_delay", "delay server", REGISTRY)  # fsyncs: the server sets its `source`
PENDING = Gauge("qmq_delay_pending", "Messages not yet delivered, by bucket", ["bucket"], registry=REGISTRY)


class SchedulerCollector:
    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None

    def collect(self):
        s = self.scheduler
        if s is None:
            return
        for name, help_text, value in (
            ("qmq_delay_scheduled", "Delayed messages accepted", s.counters["scheduled"]),
            ("qmq_delay_fired", "Delayed messages delivered to a broker", s.counters["fired"]),
            ("qmq_delay_cancelled", "Messages not delivered because they were cancelled", s.counters["skipped"]),
            ("qmq_delay_delivery_failures", "Deliveries that failed and will be retried", s.counters["failures"]),
        ):
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], value)
            yield counter
        for name, help_text, value in (
            ("qmq_delay_wheel_messages", "Messages in the in-memory wheel", len(s.wheel)),
            ("qmq_delay_parked_messages", "Due messages waiting for a broker of their subject", len(s.parking)),
            ("qmq_delay_releasing_messages", "Released messages not yet back in the wheel", s.parking.releasing_count),
            ("qmq_delay_held_messages", "Due messages read from disk, not yet delivered (--max-held)", s.held),
            ("qmq_delay_due_waiting_messages", "Due messages left in the wheel for want of room", s.due_waiting()),
            ("qmq_delay_loaded_buckets", "Buckets loaded into the wheel", len(s.loaded)),
            ("qmq_delay_cancels_kept", "Cancelled ids kept in memory", len(s.cancels)),
        ):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], value)
            yield gauge
        histogram = HistogramMetricFamily("qmq_delay_lateness_seconds", "Delivery time minus due time")
        histogram.add_metric([], s.lateness.buckets(), s.lateness.total)
        yield histogram


COLLECTOR = SchedulerCollector()
REGISTRY.register(COLLECTOR)


def update(scheduler: Scheduler) -> None:
    pending = scheduler.pending_by_bucket()
    PENDING.clear()
    for name, count in pending.items():
        PENDING.labels(name).set(count)
