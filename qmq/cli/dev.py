"""`qmq dev`: the embedded cluster (meta server, one broker group, the delay server, a relay, the web
console) in one command, until Ctrl-C (qmq/dev/cluster.py). A server that exits is reported and started again; the
others keep running."""

from __future__ import annotations

import os
import signal
import threading

import click

from qmq.cli.options import metrics_port_option, tuning
from qmq.db.url import DB_URL_ENV
from qmq.dev.cluster import BROKER_PORT, CONSOLE_PORT, DELAY_PORT, META_PORT, RESTART_AFTER_S, DevCluster
from qmq.net.tls import TLS_CA_ENV

WATCH_INTERVAL_S = 1.0
PORT = click.IntRange(0, 65535)
DATA_DIR_HELP = "stores, databases and logs of the cluster"
DB_HELP = (
    "your app's database: its outbox is what the relay ships (and the meta server's tables go there) "
    f"[env {DB_URL_ENV}; default SQLite files in DATA_DIR]"
)
METRICS_HELP = (
    "serve Prometheus metrics: the meta server on this port, the broker, delay server and relay on the next "
    "ones (0: free ports) [default: none]"
)
RESTART_HELP = (
    f"seconds before a server that exited is started again (doubling if it keeps dying) [default: {RESTART_AFTER_S:g}]"
)

TLS_HELP = (
    "every server speaks TLS only, with a certificate made for the session (openssl); "
    f"the banner prints the CA file clients need ({TLS_CA_ENV})"
)


@click.command("dev")
@click.option("--data-dir", default="qmq-dev", show_default=True, type=click.Path(file_okay=False), help=DATA_DIR_HELP)
@click.option("--db", "db_url", default=None, metavar="URL", help=DB_HELP)
@tuning("--meta-port", PORT, META_PORT, "0: a free port")
@tuning("--broker-port", PORT, BROKER_PORT, "0: a free port")
@tuning("--delay-port", PORT, DELAY_PORT, "0: a free port")
@tuning("--console-port", PORT, CONSOLE_PORT, "the web console")
@click.option("--no-console", is_flag=True, help="do not start the web console")
@metrics_port_option(METRICS_HELP)
@click.option("--restart-after", type=click.FloatRange(min=0), default=RESTART_AFTER_S, help=RESTART_HELP)
@click.option("--tls", is_flag=True, help=TLS_HELP)
def dev(
    data_dir: str,
    db_url: str | None,
    meta_port: int,
    broker_port: int,
    delay_port: int,
    console_port: int,
    no_console: bool,
    metrics_port: int | None,
    restart_after: float,
    tls: bool,
) -> None:
    """Run a meta server, a broker group, the delay server, a relay and the web console until Ctrl-C
    (with --tls, all of them over TLS)."""
    db_url = db_url or os.environ.get(DB_URL_ENV) or None
    cluster = DevCluster(
        data_dir,
        outbox_url=db_url,
        meta_db_url=db_url,
        meta_port=meta_port,
        broker_port=broker_port,
        delay_port=delay_port,
        console_port=None if no_console else console_port,
        metrics_port=metrics_port,
        restart_after_s=restart_after,
        tls=tls,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
    except RuntimeError as exc:  # CertificateError included
        raise click.ClickException(str(exc)) from None
    click.echo(cluster.describe(), err=False)
    try:
        while not stop.wait(WATCH_INTERVAL_S):
            for event in cluster.supervise():
                click.echo(f"qmq dev: {event}", err=True)
    finally:
        click.echo("stopping the cluster...", err=True)
        cluster.stop()
    click.echo("stopped", err=True)
