"""The `qmq broker` process: open the store, recover consumption state, serve, register with the meta
server when one is given, and shut down cleanly on SIGTERM or SIGINT (a snapshot is written, the store
checkpointed and closed; the process exits 0).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path

from qmq import metrics as prometheus
from qmq.broker import metrics
from qmq.broker.ahead import AHEAD_WINDOW_S
from qmq.broker.core import DEFAULT_CONSUMER_TIMEOUT_S, DEFAULT_MAX_ATTEMPTS
from qmq.broker.queue_lease import ORDERED_LEASE_S
from qmq.broker.roles import BrokerDuty
from qmq.broker.state_copy import discard_interrupted
from qmq.net.server import Server, run_process, stop_on_signals
from qmq.replication.roles import Roles, join
from qmq.store import speedups
from qmq.store.flush import FlushMode
from qmq.store.followers import MAX_LAG_S
from qmq.store.store import DEFAULT_CLEAN_INTERVAL_S, LogStore, StoreConfig

log = logging.getLogger("qmq.broker")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 20881
METRICS_INTERVAL_S = 5.0  # the per-group gauges are refreshed this often
CLEANS_PER_RETENTION = 10  # a short log retention (tests) is looked at this often per period, at least


def store_config_for(segment_bytes: int, log_retention_s: float) -> StoreConfig:
    """The broker's log-store settings: `segment_bytes`, and the message log's retention, which the
    cleaner checks at least every tenth of it (never less than its default interval)."""
    return StoreConfig(
        segment_bytes=segment_bytes,
        retention_s=log_retention_s,
        clean_interval_s=min(DEFAULT_CLEAN_INTERVAL_S, log_retention_s / CLEANS_PER_RETENTION),
    )


async def serve_broker(
    data_dir: str | Path,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    meta: str | None = None,
    group: str | None = None,
    advertise: str | None = None,
    advertise_external: str | None = None,
    flush: str = "sync",
    token: str | None = None,
    metrics_port: int | None = None,
    consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S,
    ahead_window_s: float = AHEAD_WINDOW_S,
    ordered_lease_s: float = ORDERED_LEASE_S,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ack_replicas: int | None = None,
    max_lag_s: float = MAX_LAG_S,
    store_config: StoreConfig | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """With `meta`, the meta server makes this broker its group's master or a replica
    (qmq/replication/roles.py, docs/replication.md); without, it is master alone, as before replication."""
    config = replace(store_config or StoreConfig(), flush=FlushMode(flush))
    await asyncio.to_thread(discard_interrupted, Path(data_dir))  # a crash while installing a copy (state_copy.py)
    store = await asyncio.to_thread(LogStore, data_dir, config)
    roles = None
    try:
        server = Server(lambda request, peer: roles.handle(request, peer), host=host, port=port, token=token)
        await server.start()
        address = advertise or f"{host}:{server.port}"
        group_name = group or f"broker-{server.port}"
        options = {
            "consumer_timeout_s": consumer_timeout_s,
            "max_attempts": max_attempts,
            "ahead_window_s": ahead_window_s,
        }
        duty = BrokerDuty({**options, "ordered_lease_s": ordered_lease_s}, config)
        roles = Roles(
            store,
            config,
            duty,
            group=group_name,
            address=address,
            token=token,
            replicated=bool(meta),
            ack_replicas=ack_replicas,
            max_lag_s=max_lag_s,
        )
        metrics.STORE.source = lambda: roles.store.flusher  # the store of now: a replica's is reopened after a cut
        if stop is None:
            stop = stop_on_signals()
        if metrics_port is not None:
            metrics_port = prometheus.serve(metrics.REGISTRY, host, metrics_port)
            log.info("metrics on http://%s:%d/metrics", host, metrics_port)
        await roles.start()
        refresher = asyncio.create_task(_refresh_metrics(roles))
        membership = None
        if meta:
            membership = join(roles, meta, kind="broker", external_address=advertise_external)
        speedups.log_in_use(log)
        log.info(
            "broker group %s ready on %s (data %s, flush %s%s)",
            group_name,
            address,
            data_dir,
            flush,
            f", meta {meta}" if meta else ", no meta server",
        )
        await stop.wait()
        log.info("shutting down")
        refresher.cancel()
        if membership is not None:
            await membership.close()
        await server.close()
        await roles.close()
    finally:
        await asyncio.to_thread((roles.store if roles is not None else store).close)
    log.info("broker stopped")


async def _refresh_metrics(roles: Roles) -> None:
    while True:
        if roles.service is not None:
            metrics.update(roles.service.stats())
        await asyncio.sleep(METRICS_INTERVAL_S)


def run(data_dir: str | Path, **kwargs) -> None:
    """The `qmq broker` process: `serve_broker` on uvloop when it is installed."""
    run_process(serve_broker(data_dir, **kwargs))
