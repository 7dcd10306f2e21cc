"""`qmq meta`: run the meta server (registration, heartbeats, routes; see docs/meta.md)."""

from __future__ import annotations

from typing import Any

import click
import sqlalchemy as sa

from qmq.cli.net_options import server_net_options
from qmq.cli.options import POSITIVE_SECONDS, listen_options, log_level_option, serving_options, setup_logging, tuning
from qmq.db.url import DB_URL_ENV, DEFAULT_META_DB_URL, resolve_url
from qmq.meta.election import FAILOVER_AFTER_S
from qmq.meta.registry import UNAVAILABLE_AFTER_S
from qmq.meta.server import DEFAULT_HOST, DEFAULT_PORT, run

FAILOVER_HELP = "seconds without a heartbeat from a replicated group's master before an in-sync replica replaces it"


@click.command("meta")
@server_net_options
@listen_options(DEFAULT_HOST, DEFAULT_PORT)
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
@serving_options()
@tuning(
    "--heartbeat-timeout",
    POSITIVE_SECONDS,
    UNAVAILABLE_AFTER_S,
    "seconds without a heartbeat after which a server is unavailable",
    "heartbeat_timeout_s",
)
@tuning("--failover-after", POSITIVE_SECONDS, FAILOVER_AFTER_S, FAILOVER_HELP, "failover_after_s")
@log_level_option("INFO", "DEBUG, INFO, WARNING or ERROR")
def meta(db_url: str | None, log_level: str, **settings: Any) -> None:
    """Run the meta server: broker groups and delay servers register and heartbeat here, and
    producers and consumers ask it which broker groups carry a subject."""
    setup_logging(log_level, server=True)
    url = resolve_url(db_url, DEFAULT_META_DB_URL)
    settings["token"] = settings["token"] or None
    try:
        run(url, **settings)
    except sa.exc.OperationalError as exc:  # only at start: later outages are answered with UNAVAILABLE
        raise click.ClickException(f"cannot reach the meta database: {str(exc.orig or exc).strip()}") from None
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {settings['host']}:{settings['port']}: {exc}") from None
