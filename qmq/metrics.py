"""Prometheus plumbing shared by qmq's servers.

Each server keeps its metrics in its own registry, so a process shows only its own (every `qmq`
command imports every server module; one default registry would give a broker the meta server's
gauges). Each registry also carries the process and platform collectors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, start_http_server


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
