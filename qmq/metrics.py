"""Prometheus plumbing shared by qmq's servers.

Each server keeps its metrics in its own registry, so a process shows only its own (every `qmq`
command imports every server module; one default registry would give a broker the meta server's
gauges). Each registry also carries the process and platform collectors. Counters of hot paths are
plain numbers read at scrape time (`Histogram`, `RequestMetrics`).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric


def new_registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def serve(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` on http://host:port/metrics from a background thread; the port bound (port 0
    picks a free one)."""
    started = start_http_server(port, addr=host, registry=registry)
    if isinstance(started, tuple):  # prometheus-client >= 0.19 returns (server, thread)
        return started[0].server_port
    return port


class Histogram:
    """Observations counted into fixed buckets (upper bounds, in seconds), without the lock that
    prometheus-client takes per observation: for hot paths, read at scrape time."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative counts by upper bound, as Prometheus wants them."""
        out, cumulative = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            cumulative += count
            out.append(("+Inf" if bound == math.inf else str(bound), cumulative))
        return out


LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ReplicationMetrics:
    """A replicated server's role and its replicas (docs/replication.md): `<prefix>_role{role}`,
    `<prefix>_epoch`, and on a master `<prefix>_replica_in_sync{replica}`,
    `<prefix>_replica_lag_bytes{replica}`, `<prefix>_replica_lag_seconds{replica}`."""

    ROLES = ("master", "replica", "pending")

    def __init__(self, prefix: str, server: str, registry: CollectorRegistry) -> None:
        self.role = Gauge(
            f"{prefix}_role",
            f"1 for this {server}'s role in its group (master, replica, pending)",
            ["role"],
            registry=registry,
        )
        self.epoch = Gauge(f"{prefix}_epoch", f"The group epoch this {server} knows", registry=registry)
        self.in_sync = Gauge(
            f"{prefix}_replica_in_sync", "1 while a replica is in sync (on the master)", ["replica"], registry=registry
        )
        self.lag_bytes = Gauge(
            f"{prefix}_replica_lag_bytes", "How far a replica's durable log is behind", ["replica"], registry=registry
        )
        self.lag_seconds = Gauge(
            f"{prefix}_replica_lag_seconds",
            "How long since a replica last caught up with the log end",
            ["replica"],
            registry=registry,
        )

    def set_role(self, role: str, epoch: int) -> None:
        for name in self.ROLES:
            self.role.labels(name).set(1 if name == role else 0)
        self.epoch.set(epoch)

    def set_replicas(self, replicas: Sequence[dict]) -> None:
        for r in replicas:
            self.in_sync.labels(r["address"]).set(1 if r["in_sync"] else 0)
            self.lag_bytes.labels(r["address"]).set(r["lag_bytes"])
            self.lag_seconds.labels(r["address"]).set(r["lag_s"])


class RequestMetrics:
    """Per request name: `<prefix>_requests_total`, `<prefix>_request_errors_total{error}` and the
    handling time `<prefix>_request_seconds`. Plain counters read at scrape time, so the request
    path pays no lock (the request count is the histogram's)."""

    def __init__(self, prefix: str, server: str, registry: CollectorRegistry) -> None:
        self.prefix = prefix
        self.server = server  # "broker", "delay server", ...: in the help texts
        self.errors: collections.Counter[tuple[str, str]] = collections.Counter()
        self.latency: dict[str, Histogram] = {}
        registry.register(self)

    def observe(self, name: str, seconds: float) -> None:
        """A request `name` was answered after `seconds`: the hot path, one call per request."""
        histogram = self.latency.get(name)
        if histogram is None:
            histogram = self.latency[name] = Histogram(LATENCY_BUCKETS_S)
        histogram.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        histogram.total += seconds

    def error(self, name: str, error: str) -> None:
        self.errors[(name, error)] += 1

    def collect(self) -> Iterator[Metric]:
        latency = list(self.latency.items())
        requests = CounterMetricFamily(
            f"{self.prefix}_requests", f"Requests handled by the {self.server}", labels=["request"]
        )
        for name, histogram in latency:
            requests.add_metric([name], histogram.count)
        yield requests
        errors = CounterMetricFamily(
            f"{self.prefix}_request_errors", "Requests answered with an error frame", labels=["request", "error"]
        )
        for (name, error), count in list(self.errors.items()):
            errors.add_metric([name, error], count)
        yield errors
        seconds = HistogramMetricFamily(
            f"{self.prefix}_request_seconds", "Time from a request's arrival to its answer", labels=["request"]
        )
        for name, histogram in latency:
            seconds.add_metric([name], histogram.buckets(), histogram.total)
        yield seconds


class StoreMetrics:
    """The message log's fsyncs, read at scrape time from the store's flusher that `source()` returns
    (the store the server has now: a replica's is reopened after a cut): `<prefix>_fsyncs_total{thread}`,
    by the flusher thread or by the caller's own (a caught-up replica's event loop), and
    `<prefix>_fsync_seconds`. A slow disk shows here first: every acknowledgement waits for one."""

    def __init__(self, prefix: str, server: str, registry: CollectorRegistry) -> None:
        self.prefix = prefix
        self.server = server
        self.source: Callable[[], Any] = lambda: None  # -> qmq.store.flush.Flusher | None
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        flusher = self.source()
        if flusher is None:
            return
        fsyncs = CounterMetricFamily(
            f"{self.prefix}_fsyncs",
            f"fsyncs of the {self.server}'s message log, by the thread that ran them",
            labels=["thread"],
        )
        fsyncs.add_metric(["flusher"], flusher.syncs_by_thread)
        fsyncs.add_metric(["caller"], flusher.syncs_here)
        yield fsyncs
        seconds = HistogramMetricFamily(
            f"{self.prefix}_fsync_seconds", f"Time of each fsync of the {self.server}'s message log"
        )
        seconds.add_metric([], flusher.sync_seconds.buckets(), flusher.sync_seconds.total)
        yield seconds
