"""`qmq console`: the web console (qmq/console/), until Ctrl-C or SIGTERM."""

from __future__ import annotations

from pathlib import Path

import click

from qmq.cli import options
from qmq.cli.time_options import DURATION
from qmq.db.url import DB_URL_ENV
from qmq.net.common import TOKEN_ENV

SECONDS_MIN_TENTH = click.FloatRange(min=0.1)
FOLDER = click.Path(file_okay=False, path_type=Path)
FILE = click.Path(dir_okay=False, path_type=Path)
SAMPLE_HELP = "how often the figures are sampled for the charts"
REFRESH_HELP = "live parts of pages are fetched again this often (0: never)"
REPORTS_HELP = "where `qmq reconcile --out` writes (or a folder of such folders)"
DB_HELP = f"the app's database, for outbox rows in look-ups [env {DB_URL_ENV}]"


@click.command("console")
@options.meta_option()
@options.brokers_option("a broker to show directly, without a meta server (repeat)")
@options.delay_servers_option("a delay server to show directly (repeat)")
@options.token_option(f"the servers' token; also what acting in the console asks for [env {TOKEN_ENV}]")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@options.tuning("--port", click.IntRange(0, 65535), 20900, "0: a free port")
@options.tuning("--sample-interval", SECONDS_MIN_TENTH, 5.0, SAMPLE_HELP, "sample_interval_s", metavar="SECONDS")
@options.tuning("--history", DURATION, "1h", "how much of the past the charts keep")
@options.tuning("--refresh", click.FloatRange(min=0), 5.0, REFRESH_HELP, "refresh_s", metavar="SECONDS")
@click.option("--reports", type=FOLDER, default=None, metavar="DIR", help=REPORTS_HELP)
@click.option("--db", "db_url", envvar=DB_URL_ENV, default=None, metavar="URL", help=DB_HELP)
@click.option("--read-only", is_flag=True, help="no actions, even with the token")
@click.option(
    "--action-log", type=FILE, default=None, metavar="FILE", help="also append every action to FILE (JSON lines)"
)
@options.log_level_option("INFO")
def console(meta, brokers, history, log_level, **settings) -> None:
    """Serve the web console: the cluster, subjects, consumer groups with backlog and rates over time,
    dead letters (re-drive, purge), message look-up, delay servers, workers, the last
    reconciliation. Reading needs nothing; acting needs the token (read-only without it)."""
    try:
        from qmq.console.server import ConsoleSettings, serve
    except ImportError as exc:
        raise click.ClickException(f"the console needs its extra: pip install 'qmq[console]' ({exc})") from None
    options.setup_logging(log_level)
    settings["token"] = settings["token"] or None
    chosen = ConsoleSettings(
        meta=options.choose_meta(meta, brokers), brokers=brokers, history_s=history.total_seconds(), **settings
    )
    try:
        serve(chosen)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
