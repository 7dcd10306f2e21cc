"""`qmq reconcile`: the nightly reconciliation (spark_etl/, docs/reconcile.md). The same command is the
entry point of `spark-submit spark_etl/reconcile.py ...`: there the master is spark-submit's, here it
is `local[*]` unless `--master` says otherwise.

Exit codes: 0 within the thresholds; 3 `not_shipped` or `not_acked` over its threshold; 4 critical
(a rolled-back transaction's message on a broker); 1 the run failed (a source could not be read, the
JDBC driver is missing); 2 a bad command line.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from qmq.cli.options import tuning
from qmq.cli.time_options import DURATION, TIME, Parsed
from spark_etl.settings import Settings, Threshold

DEFAULT_SINCE, DEFAULT_UNTIL = "yesterday", "today"
log = logging.getLogger("qmq.reconcile")


IGNORE_GROUP_HELP = "a retired consumer group, not expected to acknowledge anything (repeat)"
REDRIVE_DEAD_HELP = "ask the brokers to send the dead letters of the window's dead-lettering groups back to them"
DRIVER_MEMORY_HELP = "Spark driver memory, e.g. 4g (not under spark-submit: give it --driver-memory there)"
THRESHOLD = Parsed("N|P%", Threshold.parse, Threshold)


@click.command()
@click.option(
    "--outbox-db",
    "outbox_dbs",
    multiple=True,
    required=True,
    metavar="URL",
    help="a PostgreSQL database with a qmq_outbox table (repeat for several)",
)
@click.option(
    "--ledger",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="the ledger directory written by `qmq ledger export`",
)
@click.option(
    "--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="where to write the results"
)
@click.option("--since", type=TIME, default=DEFAULT_SINCE, show_default=True, help="start of the window")
@click.option("--until", type=TIME, default=DEFAULT_UNTIL, show_default=True, help="end of the window (excluded)")
@click.option(
    "--grace",
    type=DURATION,
    default="15m",
    show_default=True,
    help="messages younger than this at the ledger's export are in flight, not anomalies",
)
@click.option(
    "--consumed-db",
    "consumed_dbs",
    multiple=True,
    metavar="URL",
    help="a database with consumers' qmq_consumed idempotency records (repeat for several)",
)
@click.option(
    "--max-not-shipped",
    type=THRESHOLD,
    default="0",
    show_default=True,
    help="exit 3 when more not_shipped messages than this (a count, or a percentage: 0.01%)",
)
@click.option(
    "--max-not-acked",
    type=THRESHOLD,
    default="0",
    show_default=True,
    help="exit 3 when more not_acked messages than this",
)
@click.option("--ignore-group", "ignore_groups", multiple=True, metavar="GROUP", help=IGNORE_GROUP_HELP)
@click.option("--redrive", is_flag=True, help="put the outbox rows of not_shipped messages back to pending")
@click.option("--redrive-dead", is_flag=True, help=REDRIVE_DEAD_HELP)
@click.option("--broker", "brokers", multiple=True, metavar="H:P", help="brokers for --redrive-dead (repeat)")
@click.option("--meta", default=None, metavar="H:P", help="meta server for --redrive-dead (instead of --broker)")
@tuning("--jdbc-partitions", click.IntRange(1, 64), 4, "parallel reads (and connections) per outbox database")
@click.option("--master", default=None, help="Spark master (default: local[*]; spark-submit's under spark-submit)")
@click.option("--driver-memory", metavar="SIZE", help=DRIVER_MEMORY_HELP)
@click.option(
    "-l",
    "--log-level",
    default="WARNING",
    show_default=True,
    help="DEBUG, INFO (each step's time), WARNING or ERROR (logged to stderr)",
)
def reconcile(master, driver_memory, log_level, **options) -> None:
    """Reconcile outbox rows with the broker ledger and the consumers' records for the window
    [--since, --until): write summary.json, the anomalies (Parquet), report.md and anomalies.png
    into --out. Exit 0 within the thresholds, 3 over one, 4 critical, 1 failed."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Every other option is a setting of the same name; a repeated one comes as a tuple.
    settings = Settings(**{name: list(v) if isinstance(v, tuple) else v for name, v in options.items()})
    try:
        settings.check()
        from spark_etl.sources import LedgerExports, parse_databases

        parse_databases(settings.outbox_dbs + settings.consumed_dbs)
        LedgerExports.read(settings.ledger, settings.since)
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the spark extra (pip install 'qmq[spark]')") from None
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    findings = run_reconciliation(settings, master, driver_memory)
    from spark_etl.report import summary

    brief = {k: v for k, v in summary(findings).items() if k not in ("sources", "window", "subjects", "groups")}
    click.echo(json.dumps(brief))
    click.echo(f"report: {settings.out / 'report.md'}", err=True)
    sys.exit(findings.exit_code)


def run_reconciliation(settings, master: str | None, driver_memory: str | None):
    """Start (or join) Spark and run; a failure becomes a ClickException (exit 1)."""
    try:
        from spark_etl.job import run
        from spark_etl.session import JdbcDriverMissing, default_master, spark_session
    except ImportError as exc:
        raise click.ClickException(f"{exc}: install the spark extra (pip install 'qmq[spark]')") from None
    try:
        spark = spark_session(master or default_master(), driver_memory=driver_memory)
    except JdbcDriverMissing as exc:
        raise click.ClickException(str(exc)) from None
    try:
        return run(spark, settings)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:
        log.exception("the reconciliation failed")
        raise click.ClickException(f"the reconciliation failed: {type(exc).__name__}: {_cause(exc)}") from exc


def _cause(exc: Exception) -> str:
    """The line of an error that says what went wrong (a Java error's first line names only the call)."""
    lines = [line.strip(" :") for line in str(exc).splitlines() if line.strip(" :")]
    named = [line for line in lines if "Exception" in line or "Error" in line]
    return (named or lines or [""])[0]
