"""`qmq log verify` and `qmq log dump` look inside a broker's or delay server's store, read-only;
`qmq log repair` is what a store that refuses to open asks for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from delay_server import records as delay_records
from delay_server.verify import delayed_to_json, is_delay_store, iter_scheduled, verify_delay_files
from qmq.store.recovery import CorruptStoreError
from qmq.store.store import LogStore, StoreConfig, StoreError
from qmq.store.verify import iter_records, record_to_json, verify


@click.group()
def log() -> None:
    """Inspect a store directory (verify and dump: read-only, safe on a live store) or repair it."""


def _data_dir(path: str) -> Path:
    data_dir = Path(path)
    if not (data_dir / "messagelog").is_dir():
        raise click.UsageError(f"{data_dir} is not a qmq store: it has no messagelog/ directory")
    return data_dir


@log.command("verify")
@click.option("--data-dir", required=True, type=click.Path(exists=True, file_okay=False), help="store directory")
def verify_cmd(data_dir: str) -> None:
    """CRC-check every record and every consume-log entry (and a delay server's schedule log,
    dispatch logs and cancels); exit 1 naming file and offset of each bad one."""
    report = verify(_data_dir(data_dir))
    delay = verify_delay_files(Path(data_dir), report) if is_delay_store(Path(data_dir)) else None
    for note in report.notes:
        click.echo(f"note: {note}")
    for problem in report.problems:
        click.echo(f"BAD {problem}")
    click.echo(
        f"{report.segments} segments, {report.records} records, {report.blank_records} blank, "
        f"{report.consume_entries} consume-log entries"
        + (
            f", {delay.buckets} buckets, {delay.scheduled} scheduled, {delay.dispatched} dispatched, "
            f"{delay.cancels} cancels"
            if delay
            else ""
        )
        + f": {'OK' if report.ok else 'CORRUPT'}"
    )
    sys.exit(0 if report.ok else 1)


@log.command("dump")
@click.option("--data-dir", required=True, type=click.Path(exists=True, file_okay=False), help="store directory")
@click.option("--subject", default=None, help="only records of this subject")
@click.option("--schedule", is_flag=True, help="a delay server's schedule log (bucket by bucket), not its message log")
def dump_cmd(data_dir: str, subject: str | None, schedule: bool) -> None:
    """Print records as JSON lines, in log order (a delay server's with their due time)."""
    out = sys.stdout
    path = _data_dir(data_dir)
    delay = is_delay_store(path)
    if schedule and not delay:
        raise click.UsageError(f"{data_dir} is not a delay server's directory: it has no schedule log")
    found = ((name, r) for name, r in iter_scheduled(path)) if schedule else ((None, r) for r in iter_records(path))
    for bucket, record in found:
        if subject is None or record.subject == subject:
            item = record_to_json(record)
            if delay and record.flags & (delay_records.DELAYED | delay_records.CANCEL):
                item.pop("payload_base64", None)
                item.update(delayed_to_json(record))
            if bucket is not None:
                item["bucket"] = bucket
            out.write(json.dumps(item) + "\n")


@log.command("repair")
@click.option("--data-dir", required=True, type=click.Path(exists=True, file_okay=False), help="store directory")
def repair_cmd(data_dir: str) -> None:
    """Open a stopped store with repair: damaged regions of the message log are moved to
    DATA_DIR/quarantine/ (blanked in place, so offsets stay), a torn tail is cut, and the derived
    files (consume logs, key index, checkpoint) are rebuilt from the message log. Every valid record
    is kept. Prints what was done; then `qmq log verify` should say OK."""
    path = _data_dir(data_dir)
    try:
        with LogStore(path, StoreConfig(repair=True, background=False)) as store:
            report = store.recovery
            start, end = store.start_offset, store.end_offset
    except (StoreError, CorruptStoreError, OSError) as exc:
        raise click.ClickException(f"cannot repair {data_dir}: {exc}") from None
    for note in report.repaired:
        click.echo(f"quarantined: {note}")
    if report.truncated_bytes:
        click.echo(f"torn tail cut: {report.truncated_bytes} bytes (kept in {path / 'quarantine'})")
    click.echo(
        f"message log {start}..{end}: {len(report.repaired)} damaged regions quarantined, "
        f"{report.truncated_bytes} torn bytes cut; consume logs, index and checkpoint rebuilt"
    )
