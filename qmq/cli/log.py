"""`qmq log verify` and `qmq log dump`: look inside a broker's or delay server's store, read-only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from qmq.store.verify import iter_records, record_to_json, verify


@click.group()
def log() -> None:
    """Inspect a store directory (read-only, safe on a live store)."""


def _data_dir(path: str) -> Path:
    data_dir = Path(path)
    if not (data_dir / "messagelog").is_dir():
        raise click.UsageError(f"{data_dir} is not a qmq store: it has no messagelog/ directory")
    return data_dir


@log.command("verify")
@click.option("--data-dir", required=True, type=click.Path(exists=True, file_okay=False), help="store directory")
def verify_cmd(data_dir: str) -> None:
    """CRC-check every record and every consume-log entry; exit 1 naming file and offset of each bad one."""
    report = verify(_data_dir(data_dir))
    for note in report.notes:
        click.echo(f"note: {note}")
    for problem in report.problems:
        click.echo(f"BAD {problem}")
    click.echo(f"{report.segments} segments, {report.records} records, {report.blank_records} blank, "
               f"{report.consume_entries} consume-log entries: {'OK' if report.ok else 'CORRUPT'}")
    sys.exit(0 if report.ok else 1)


@log.command("dump")
@click.option("--data-dir", required=True, type=click.Path(exists=True, file_okay=False), help="store directory")
@click.option("--subject", default=None, help="only records of this subject")
def dump_cmd(data_dir: str, subject: str | None) -> None:
    """Print records as JSON lines, in log order."""
    out = sys.stdout
    for record in iter_records(_data_dir(data_dir)):
        if subject is None or record.subject == subject:
            out.write(json.dumps(record_to_json(record)) + "\n")
