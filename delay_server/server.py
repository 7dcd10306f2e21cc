"""The `qmq delay-server` process: open the store and the schedule log, file what the last run left
unfiled, serve, register with the meta server, load and fire buckets, and shut down cleanly on
SIGTERM or SIGINT (deliveries in flight finish or are retried after the restart; everything is
checkpointed; the process exits 0).

With `--group` and a meta server the delay server joins a replicated group (docs/replication.md):
the meta server makes it master (it serves and fires) or a replica (it copies the master's log and
files it, fires nothing), `delay_server/roles.py` over `qmq/replication/roles.py`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import time
from collections.abc import Sequence
from pathlib import Path

from delay_server import metrics
from delay_server.clock import Clock
from delay_server.roles import DelayDuty, DelaySettings
from delay_server.schedule_log import DEFAULT_BUCKET_MINUTES
from delay_server.scheduler import DEFAULT_LOAD_AHEAD_S, DEFAULT_MAX_HELD, DEFAULT_RETENTION_S
from delay_server.service import DEFAULT_MAX_DELAY_S
from delay_server.snapshot import discard_interrupted
from qmq import metrics as prometheus
from qmq.client.aio import AsyncClient
from qmq.net.server import Server, run_process, stop_on_signals
from qmq.replication.roles import Roles, join
from qmq.store import speedups
from qmq.store import store as log_store
from qmq.store.followers import MAX_LAG_S
from qmq.store.store import DEFAULT_CLEAN_INTERVAL_S, LogStore, StoreConfig

log = logging.getLogger("qmq.delay")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 20890
METRICS_INTERVAL_S = 5.0
# The message log is only a write-ahead log here: small segments and frequent checkpoints keep what a
# restart CRC-checks and replays small (the newest three segments, and what follows the checkpoint).
STORE_CONFIG = StoreConfig(segment_bytes=128 * 1024 * 1024, checkpoint_bytes=64 * 1024 * 1024)
DEFAULT_LOG_RETENTION_S = log_store.DEFAULT_RETENTION_S  # the message log's; buckets keep pending messages longer
CLEANS_PER_RETENTION = 10  # a short log retention (tests) is looked at this often per period, at least


def store_config_for(segment_bytes: int | None = None, log_retention_s: float = DEFAULT_LOG_RETENTION_S) -> StoreConfig:
    """The delay server's log-store settings: `segment_bytes` (default 128 MiB) and the message
    log's retention, which the cleaner checks at least every tenth of it (never less than every
    minute)."""
    return dataclasses.replace(
        STORE_CONFIG,
        segment_bytes=segment_bytes or STORE_CONFIG.segment_bytes,
        retention_s=log_retention_s,
        clean_interval_s=min(DEFAULT_CLEAN_INTERVAL_S, log_retention_s / CLEANS_PER_RETENTION),
    )


async def serve_delay_server(
    data_dir: str | Path,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    meta: str | None = None,
    group: str | None = None,
    ack_replicas: int | None = None,
    max_lag_s: float = MAX_LAG_S,
    brokers: Sequence[str] = (),
    advertise: str | None = None,
    advertise_external: str | None = None,
    token: str | None = None,
    metrics_port: int | None = None,
    max_delay_s: float = DEFAULT_MAX_DELAY_S,
    bucket_minutes: int = DEFAULT_BUCKET_MINUTES,
    load_ahead_s: float = DEFAULT_LOAD_AHEAD_S,
    retention_s: float = DEFAULT_RETENTION_S,
    max_held: int = DEFAULT_MAX_HELD,
    clock_file: str | Path | None = None,
    segment_bytes: int | None = None,
    log_retention_s: float = DEFAULT_LOG_RETENTION_S,
    store_config: StoreConfig | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """With `meta` and `group`, the meta server makes this delay server its group's master or a
    replica; otherwise it is master alone, as before replication."""
    started = time.monotonic()
    data_dir = Path(data_dir)
    clock = Clock(clock_file)
    config = store_config or store_config_for(segment_bytes, log_retention_s)
    await asyncio.to_thread(discard_interrupted, data_dir)  # a crash while installing a copy (snapshot.py)
    store = await asyncio.to_thread(LogStore, data_dir, config)
    roles = None
    try:
        client = AsyncClient(
            meta=meta or None, brokers=list(brokers) or None, token=token, client_id=f"delay-server-{port}"
        )
        settings = DelaySettings(bucket_minutes, load_ahead_s, retention_s, max_delay_s, max_held)
        duty = DelayDuty(settings, clock, client)
        duty.on_open = lambda service: setattr(metrics.COLLECTOR, "scheduler", service.scheduler)
        server = Server(lambda request, peer: roles.handle(request, peer), host=host, port=port, token=token)
        await server.start()
        address = advertise or f"{host}:{server.port}"
        replicated = bool(meta and group)
        roles = Roles(
            store,
            config,
            duty,
            group=group or f"delay-{server.port}",
            address=address,
            token=token,
            replicated=replicated,
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
        membership = None
        if meta:
            membership = join(roles, meta, kind="delay", external_address=advertise_external, replicated=replicated)
        speedups.log_in_use(log)
        log.info(
            "delay server ready on %s in %.2f s (data %s, %d-minute buckets, delivering via %s%s%s)",
            address,
            time.monotonic() - started,
            data_dir,
            settings.bucket_minutes,
            f"meta {meta}" if meta else ", ".join(brokers),
            f", group {group}" if replicated else "",
            f", clock file {clock_file}" if clock_file else "",
        )
        refresher = asyncio.create_task(_refresh_metrics(duty))
        await stop.wait()
        log.info("shutting down")
        refresher.cancel()
        if membership is not None:
            await membership.close()
        await server.close()
        await roles.close()
        await client.close()
    finally:
        await asyncio.to_thread((roles.store if roles is not None else store).close)
    log.info("delay server stopped")


async def _refresh_metrics(duty: DelayDuty) -> None:
    while True:
        if duty.service is not None:
            metrics.update(duty.service.scheduler)
        await asyncio.sleep(METRICS_INTERVAL_S)


def raise_open_files_limit() -> None:
    """Open files as the hard limit allows: buckets, loaded buckets and dispatch logs each hold some."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(data_dir: str | Path, **kwargs) -> None:
    """The `qmq delay-server` process: `serve_delay_server` on uvloop when it is installed."""
    raise_open_files_limit()
    run_process(serve_delay_server(data_dir, **kwargs))
