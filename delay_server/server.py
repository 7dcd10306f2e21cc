"""The `qmq delay-server` process: open the store and the schedule log, file what the last run left
unfiled, serve, register with the meta server, load and fire buckets, and shut down cleanly on
SIGTERM or SIGINT (deliveries in flight finish or are retried after the restart; everything is
checkpointed; the process exits 0).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Sequence
from pathlib import Path

from delay_server import metrics
from delay_server.cancels import Cancels
from delay_server.clock import Clock
from delay_server.schedule_log import DEFAULT_BUCKET_MINUTES, ScheduleLog
from delay_server.scheduler import DEFAULT_LOAD_AHEAD_S, DEFAULT_RETENTION_S, Scheduler, release_free_memory
from delay_server.service import DEFAULT_MAX_DELAY_S, DelayService
from qmq import metrics as prometheus
from qmq.client.aio import AsyncClient
from qmq.meta.membership import Membership
from qmq.net.server import Server, run_process, stop_on_signals
from qmq.store.store import LogStore, StoreConfig

log = logging.getLogger("qmq.delay")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 20890
METRICS_INTERVAL_S = 5.0
# The message log is only a write-ahead log here: small segments and frequent checkpoints keep what a
# restart CRC-checks and replays small (the newest three segments, and what follows the checkpoint).
STORE_CONFIG = StoreConfig(segment_bytes=128 * 1024 * 1024, checkpoint_bytes=64 * 1024 * 1024)


def data_dirs(data_dir: Path) -> tuple[Path, Path, Path]:
    """(schedule log, dispatch logs, cancels) of a delay server's data directory; the message log
    (a log store) is the directory itself, so `qmq log verify/dump` read it as they read a broker's."""
    return data_dir / "schedule", data_dir / "dispatch", data_dir / "cancels"


async def serve_delay_server(
    data_dir: str | Path,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    meta: str | None = None,
    brokers: Sequence[str] = (),
    advertise: str | None = None,
    advertise_external: str | None = None,
    token: str | None = None,
    metrics_port: int | None = None,
    max_delay_s: float = DEFAULT_MAX_DELAY_S,
    bucket_minutes: int = DEFAULT_BUCKET_MINUTES,
    load_ahead_s: float = DEFAULT_LOAD_AHEAD_S,
    retention_s: float = DEFAULT_RETENTION_S,
    clock_file: str | Path | None = None,
    store_config: StoreConfig | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    started = time.monotonic()
    data_dir = Path(data_dir)
    schedule_dir, dispatch_dir, cancels_dir = data_dirs(data_dir)
    clock = Clock(clock_file)
    store = await asyncio.to_thread(LogStore, data_dir, store_config or STORE_CONFIG)
    schedule = cancels = None
    try:
        schedule = ScheduleLog(schedule_dir, bucket_minutes)
        cancels = await asyncio.to_thread(Cancels, cancels_dir)
        client = AsyncClient(
            meta=meta or None, brokers=list(brokers) or None, token=token, client_id=f"delay-server-{port}"
        )
        scheduler = Scheduler(
            schedule, dispatch_dir, cancels, clock, client, load_ahead_s=load_ahead_s, retention_s=retention_s
        )
        service = DelayService(store, schedule, cancels, scheduler, clock, max_delay_s=max_delay_s)
        await asyncio.to_thread(service.recover)
        release_free_memory()
        server = Server(service.handle, host=host, port=port, token=token)
        await server.start()
        address = advertise or f"{host}:{server.port}"
        if stop is None:
            stop = stop_on_signals()
        metrics.COLLECTOR.scheduler = scheduler
        if metrics_port is not None:
            metrics_port = prometheus.serve(metrics.REGISTRY, host, metrics_port)
            log.info("metrics on http://%s:%d/metrics", host, metrics_port)
        service.start()
        scheduler.start()
        membership = None
        if meta:
            membership = Membership(
                meta, kind="delay", group=None, address=address, external_address=advertise_external, token=token
            )
            membership.start()
        log.info(
            "delay server ready on %s in %.2f s (data %s, %d-minute buckets, delivering via %s%s)",
            address,
            time.monotonic() - started,
            data_dir,
            schedule.bucket_minutes,
            f"meta {meta}" if meta else ", ".join(brokers),
            f", clock file {clock_file}" if clock_file else "",
        )
        refresher = asyncio.create_task(_refresh_metrics(scheduler))
        await stop.wait()
        log.info("shutting down")
        refresher.cancel()
        if membership is not None:
            await membership.close()
        await server.close()
        await scheduler.close()
        await service.close()
        await client.close()
    finally:
        if schedule is not None:
            schedule.close()
        if cancels is not None:
            cancels.close()
        await asyncio.to_thread(store.close)
    log.info("delay server stopped")


async def _refresh_metrics(scheduler: Scheduler) -> None:
    while True:
        metrics.update(scheduler)
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
