"""The delay server's Prometheus metrics (docs/delay.md lists them).

Counters of the hot paths are plain ints on the scheduler, read at scrape time; the lateness
histogram keeps its own bucket counts for the same reason (prometheus-client takes a lock per
observation). `qmq_delay_pending{bucket}` is refreshed from `Scheduler.stats()` every few seconds.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from qmq.metrics import new_registry

if TYPE_CHECKING:
    from delay_server.scheduler import Scheduler

LATENESS_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)

REGISTRY = new_registry()
PENDING = Gauge("qmq_delay_pending", "Messages not yet delivered, by bucket", ["bucket"], registry=REGISTRY)


class Lateness:
    """Delivery time minus due time, in seconds: a histogram with fixed buckets."""

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENESS_BUCKETS_S) + 1)
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENESS_BUCKETS_S, seconds)] += 1
        self.total_s += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


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
            ("qmq_delay_loaded_buckets", "Buckets loaded into the wheel", len(s.loaded)),
            ("qmq_delay_cancels_kept", "Cancelled ids kept in memory", len(s.cancels)),
        ):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], value)
            yield gauge
        histogram = HistogramMetricFamily("qmq_delay_lateness_seconds", "Delivery time minus due time")
        cumulative, buckets = 0, []
        for bound, count in zip((*LATENESS_BUCKETS_S, float("inf")), s.lateness.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        histogram.add_metric([], buckets, s.lateness.total_s)
        yield histogram


COLLECTOR = SchedulerCollector()
REGISTRY.register(COLLECTOR)


def update(scheduler: Scheduler) -> None:
    pending = scheduler.pending_by_bucket()
    PENDING.clear()
    for name, count in pending.items():
        PENDING.labels(name).set(count)
