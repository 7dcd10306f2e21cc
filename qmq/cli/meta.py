"""`qmq meta`: run the meta server (registration, heartbeats, routes; see docs/meta.md)."""

from __future__ import annotations

import logging

import click
import sqlalchemy as sa

from qmq.cli.net_options import server_net_options
from qmq.db.url import DB_URL_ENV, DEFAULT_META_DB_URL, resolve_url
from qmq.meta.registry import UNAVAILABLE_AFTER_S
from qmq.meta.server import DEFAULT_HOST, DEFAULT_PORT, run
from qmq.net.common import TOKEN_ENV


@click.command("meta")
@server_net_options
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--external-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="a second listener, for clients outside the servers' network: its replies name the addresses "
    "servers advertise with --advertise-external (docs/meta.md)",
)
@click.option(
    "--db",
    "db_url",
    envvar=DB_URL_ENV,
    default=None,
    help=f"SQLAlchemy URL of the meta database [env {DB_URL_ENV}; default {DEFAULT_META_DB_URL}]",
)
@click.option("--token", envvar=TOKEN_ENV, default=None, help=f"token clients must present [env {TOKEN_ENV}]")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help="serve Prometheus metrics here")
@click.option(
    "--heartbeat-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=UNAVAILABLE_AFTER_S,
    show_default=True,
    help="seconds without a heartbeat after which a server is unavailable",
)
@click.option("-l", "--log-level", default="INFO", show_default=True, help="DEBUG, INFO, WARNING or ERROR")
def meta(
    host: str,
    port: int,
    external_port: int | None,
    db_url: str | None,
    token: str | None,
    metrics_port: int | None,
    heartbeat_timeout: float,
    log_level: str,
) -> None:
    """Run the meta server: broker groups and delay servers register and heartbeat here, and
    producers and consumers ask it which broker groups carry a subject."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    url = resolve_url(db_url, DEFAULT_META_DB_URL)
    try:
        run(
            url,
            host=host,
            port=port,
            external_port=external_port,
            token=token or None,
            heartbeat_timeout_s=heartbeat_timeout,
            metrics_port=metrics_port,
        )
    except sa.exc.OperationalError as exc:  # only at start: later outages are answered with UNAVAILABLE
        raise click.ClickException(f"cannot reach the meta database: {str(exc.orig or exc).strip()}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from None
