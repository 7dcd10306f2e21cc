"""`qmq console`: the web console (qmq/console/), until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from qmq.cli.time_options import DURATION
from qmq.client.routes import DEFAULT_META_ADDRESS, META_ENV
from qmq.db.url import DB_URL_ENV
from qmq.net.common import TOKEN_ENV


@click.command("console")
@click.option(
    "--meta",
    envvar=META_ENV,
    default=None,
    metavar="HOST:PORT",
    help=f"meta server [env {META_ENV}; default {DEFAULT_META_ADDRESS}]",
)
@click.option(
    "--broker",
    "brokers",
    multiple=True,
    metavar="HOST:PORT",
    help="a broker to show directly, without a meta server (repeat)",
)
@click.option(
    "--delay-server",
    "delay_servers",
    multiple=True,
    metavar="HOST:PORT",
    help="a delay server to show directly (repeat)",
)
@click.option(
    "--token",
    envvar=TOKEN_ENV,
    default=None,
    help=f"the servers' token; also what acting in the console asks for [env {TOKEN_ENV}]",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=click.IntRange(0, 65535), default=20900, show_default=True, help="0: a free port")
@click.option(
    "--sample-interval",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="how often the figures are sampled for the charts",
)
@click.option("--history", type=DURATION, default="1h", show_default=True, help="how much of the past the charts keep")
@click.option(
    "--refresh",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="live parts of pages are fetched again this often (0: never)",
)
@click.option(
    "--reports",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="where `qmq reconcile --out` writes (or a folder of such folders)",
)
@click.option(
    "--db",
    "db_url",
    envvar=DB_URL_ENV,
    default=None,
    metavar="URL",
    help=f"the app's database, for outbox rows in look-ups [env {DB_URL_ENV}]",
)
@click.option("--read-only", is_flag=True, help="no actions, even with the token")
@click.option(
    "--action-log",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="also append every action to FILE, one JSON line each",
)
@click.option("-l", "--log-level", default="INFO", show_default=True)
def console(
    meta,
    brokers,
    delay_servers,
    token,
    host,
    port,
    sample_interval,
    history,
    refresh,
    reports,
    db_url,
    read_only,
    action_log,
    log_level,
) -> None:
    """Serve the web console: the cluster, subjects, consumer groups with backlog and rates over time,
    dead letters (re-drive, purge), message look-up, delay servers, workers, the last
    reconciliation. Reading needs nothing; acting needs the token (read-only without it)."""
    try:
        from qmq.console.server import ConsoleSettings, serve
    except ImportError as exc:
        raise click.ClickException(f"the console needs its extra: pip install 'qmq[console]' ({exc})") from None
    logging.basicConfig(level=log_level.upper(), format="qmq %(levelname)s %(name)s: %(message)s")
    if meta and brokers:
        if click.get_current_context().get_parameter_source("meta") is not click.core.ParameterSource.ENVIRONMENT:
            raise click.UsageError("give --meta or --broker, not both")
        meta = None  # --broker wins over a meta server that came from the environment
    settings = ConsoleSettings(
        meta=meta,
        brokers=brokers,
        delay_servers=delay_servers,
        token=token or None,
        host=host,
        port=port,
        sample_interval_s=sample_interval,
        history_s=history.total_seconds(),
        refresh_s=refresh,
        reports=reports,
        db_url=db_url,
        read_only=read_only,
        action_log=action_log,
    )
    try:
        serve(settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
