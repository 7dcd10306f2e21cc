"""`qmq ledger export`: a broker's (or delay server's) store as the Parquet ledger the nightly
reconciliation reads (docs/reconcile.md). Read-only, safe on a live store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from qmq.cli.time_options import TIME

if TYPE_CHECKING:
    from qmq.ledger.export import ExportReport


def export_store(data_dir: Path, out: Path, **options: Any) -> ExportReport:
    """`qmq ledger export` of a broker's or a delay server's store, whichever `data_dir` holds
    (`qmq.ledger.export.export` takes the same `options`). Imports pyarrow: an extra."""
    from delay_server.ledger import DELAY_STORE
    from delay_server.verify import is_delay_store
    from qmq.ledger.export import BROKER_STORE, export

    return export(data_dir, out, kind=DELAY_STORE if is_delay_store(data_dir) else BROKER_STORE, **options)


EXISTING_FOLDER = click.Path(exists=True, file_okay=False)


@click.group()
def ledger() -> None:
    """The broker ledger for the nightly reconciliation."""


@ledger.command("export")
@click.option(
    "--data-dir", required=True, type=EXISTING_FOLDER, help="a broker's or delay server's store (may be in use)"
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="the ledger directory (shared by stores)")
@click.option("--since", type=TIME, default=None, help="first day to export (default: the oldest stored)")
@click.option("--until", type=TIME, default=None, help="end of the export, rounded up to a whole day (default: all)")
@click.option("--name", default=None, help="this store's name in the ledger (default: the directory's name)")
def export_cmd(data_dir: str, out: str, since, until, name: str | None) -> None:
    """Write the messages, deliveries, acks and consumer groups of a store as Parquet, by day; print
    what was written as JSON. Exit 1 if the store has damaged records (the rest is exported)."""
    if since is not None and until is not None and since >= until:
        raise click.UsageError("--since must be before --until")
    if name is not None and (not name or "/" in name or name.startswith((".", "_"))):
        raise click.UsageError(f"--name {name!r}: a store name may not be empty, hold '/' or start with '.' or '_'")
    try:
        report = export_store(Path(data_dir), Path(out), name=name, since=since, until=until)
    except ImportError as exc:  # pyarrow is an extra
        raise click.ClickException(f"{exc}: install the ledger extra (pip install 'qmq[spark]')") from None
    except FileNotFoundError as exc:
        raise click.UsageError(str(exc)) from None
    summary = {
        "name": report.name,
        "kind": report.kind,
        "as_of": report.as_of,
        "records": report.records,
        "rows": {table: sum(days.values()) for table, days in report.rows.items()},
        "days": sorted({d for days in report.rows.values() for d in days if d != "all"}),
        "kept_days": report.kept_days,
        "notes": report.notes,
        "problems": report.problems,
    }
    click.echo(json.dumps(summary, indent=2))
    sys.exit(1 if report.problems else 0)
