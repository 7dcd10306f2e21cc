"""`qmq relay`: ship the outbox rows that no after-commit sender shipped, keep sent rows for the audit
window, then purge them (qmq/outbox/relay.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import click

from qmq.cli.client_options import client_options, make_client
from qmq.cli.options import delay_servers_option, metrics_port_option, tuning
from qmq.client import Client
from qmq.db.url import DB_URL_ENV, normalize_url
from qmq.memory import collect_less, keep_large_buffers
from qmq.metrics import serve
from qmq.outbox import relay as relay_module
from qmq.outbox.metrics import REGISTRY
from qmq.outbox.relay import Relay, RelaySettings

DAY_S = 86400.0


@click.command("relay")
@click.option(
    "--db",
    "dbs",
    multiple=True,
    envvar=DB_URL_ENV,
    metavar="URL",
    help=f"an outbox database (repeat for several) [env {DB_URL_ENV}, space-separated]",
)
@client_options
@delay_servers_option("a delay server for delayed messages, without a meta server (repeat for several)")
@tuning("--batch", click.IntRange(1, 10_000), relay_module.BATCH_ROWS, "rows claimed and shipped together")
@tuning("--concurrency", click.IntRange(1, 64), relay_module.SHIPPING_THREADS, "shipping threads per database")
@tuning("--lease", click.FloatRange(min=1), relay_module.LEASE_S, "seconds a claimed row stays this relay's")
@tuning(
    "--poll-interval",
    click.FloatRange(min=0.01),
    relay_module.POLL_INTERVAL_S,
    "longest sleep between looks (PostgreSQL NOTIFY wakes it sooner)",
)
@tuning(
    "--keep-sent-days",
    click.FloatRange(min=0),
    relay_module.KEEP_SENT_S / DAY_S,
    "the audit window: sent rows are purged after it",
)
@tuning("--purge-batch", click.IntRange(1), relay_module.PURGE_BATCH_ROWS, "rows deleted per purge transaction")
@tuning(
    "--flag-after",
    click.FloatRange(min=0),
    relay_module.FLAG_AFTER_S,
    "seconds pending after which a row is flagged and logged",
)
@tuning(
    "--flag-attempts",
    click.IntRange(1),
    relay_module.FLAG_AFTER_ATTEMPTS,
    "failed attempts after which a row is flagged and logged",
)
@click.option(
    "--no-listen",
    is_flag=True,
    help="do not LISTEN for the NOTIFY of new rows, only poll (behind PgBouncer in transaction mode)",
)
@metrics_port_option()
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option("--once", is_flag=True, help="one sweep (ship what is due, flag, purge), print a JSON report, exit")
def relay(
    dbs: tuple[str, ...],
    meta: str | None,
    brokers: tuple[str, ...],
    token: str | None,
    log_level: str,
    delay_servers: tuple[str, ...],
    batch: int,
    concurrency: int,
    lease: float,
    poll_interval: float,
    keep_sent_days: float,
    purge_batch: int,
    flag_after: float,
    flag_attempts: int,
    no_listen: bool,
    metrics_port: int | None,
    metrics_host: str,
    once: bool,
) -> None:
    """Ship committed outbox rows left unsent (crash, broker down), until SIGTERM."""
    keep_large_buffers()  # its sends are batches of hundreds of rows (qmq/memory.py)
    collect_less()  # a few objects per row
    urls = [normalize_url(u) for value in dbs for u in value.split()]
    if not urls:
        raise click.UsageError(f"give at least one --db URL (or set ${DB_URL_ENV})")
    if log_level.upper() == "WARNING":
        log_level = "INFO"  # a service logs its start, stop and purges
    probe = make_client(meta, brokers, token, log_level, delay_servers=list(delay_servers))  # bad addresses: now
    probe.close()
    settings = RelaySettings(
        batch_rows=batch,
        lease_s=lease,
        poll_interval_s=poll_interval,
        shipping_threads=concurrency,
        keep_sent_s=keep_sent_days * DAY_S,
        purge_batch_rows=purge_batch,
        flag_after_s=flag_after,
        flag_after_attempts=flag_attempts,
        listen=not no_listen,
    )
    service = Relay(
        urls,
        lambda: Client(
            meta=probe.meta,
            brokers=probe.brokers,
            delay_servers=list(delay_servers),
            token=token or None,
            client_id="relay",
        ),
        settings,
    )
    if once:
        reports = service.sweep()
        for report in reports:
            click.echo(json.dumps(report.__dict__))
        sys.exit(1 if any(r.errors for r in reports) else 0)
    if metrics_port is not None:
        bound = serve(REGISTRY, metrics_host, metrics_port)
        logging.getLogger(__name__).info("metrics on http://%s:%d/metrics", metrics_host, bound)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop.set())
    if stuck := service.run():
        exit_without(stuck)


def exit_without(stuck: list[str]) -> None:
    """The batches of `stuck` did not finish within the lease: their sends wait for a broker that does
    not answer, and the interpreter's exit would wait for them too (the client's send threads are
    joined at exit), up to their own timeouts. Exit now: the transactions end with the connections,
    so their rows stay pending for the next relay."""
    logging.getLogger(__name__).warning(
        "%s still in a batch after the lease: exiting without them; their rows stay pending", ", ".join(stuck)
    )
    logging.shutdown()
    os._exit(0)
