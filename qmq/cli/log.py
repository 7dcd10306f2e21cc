"""`qmq log verify` and `qmq log dump`: look inside a broker's or delay server's store, read-only."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from delay_server import records as delay_records
from delay_server.server import STORE_CONFIG as DELAY_STORE_CONFIG
from delay_server.verify import delayed_to_json, is_delay_store, iter_scheduled, verify_delay_files
from qmq.broker import snapshot
from qmq.broker.service import STATE_DIR
from qmq.store.store import LogStore, StoreConfig, StoreError
from qmq.store.verify import VerifyReport, iter_records, record_to_json, verify


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
    """CRC-check every record, consume-log entry, the checkpoint and the consumption snapshot (and a
    delay server's schedule log, dispatch logs and cancels); exit 1 naming file and offset of each bad
    one."""
    report = verify(_data_dir(data_dir))
    _verify_snapshot(Path(data_dir), report)
    delay = verify_delay_files(Path(data_dir), report) if is_delay_store(Path(data_dir)) else None
    for note in report.notes:
        click.echo(f"note: {note}")
    for problem in report.problems:
        click.echo(f"BAD {problem}")
    click.echo(
        f"{report.segments} segments, {report.records} records, {report.blank_records} blank, "
        f"{report.consume_entries} consume-log entries, {report.checked_files} checkpoints and snapshots"
        + (
            f", {delay.buckets} buckets, {delay.scheduled} scheduled, {delay.dispatched} dispatched, "
            f"{delay.cancels} cancels"
            if delay
            else ""
        )
        + f": {'OK' if report.ok else 'CORRUPT'}"
    )
    sys.exit(0 if report.ok else 1)


def _verify_snapshot(data_dir: Path, report: VerifyReport) -> None:
    """A broker's consumption snapshots (the newest and the older ones kept): their CRCs (a broker
    passes over a bad one for an older one, or replays its journal)."""
    for path in snapshot.files(data_dir / STATE_DIR):
        try:
            snapshot.read(path)
        except snapshot.SnapshotError as exc:
            report.problems.append(str(exc))
            continue
        except FileNotFoundError:  # a live broker rotated it meanwhile
            continue
        report.checked_files += 1


@log.command("repair")
@click.option("--data-dir", required=True, type=click.Path(exists=True, file_okay=False), help="store directory")
def repair_cmd(data_dir: str) -> None:
    """Repair a store the server refused to open (run it with the server stopped): damaged regions of
    the message log are copied to DATA_DIR/quarantine/ and covered by blank records of the same size,
    a torn tail is cut (and kept there too), and the consume logs, key index and checkpoint are
    rebuilt from the message log. Every valid record is kept. Prints what it did."""
    path = _data_dir(data_dir)
    config = DELAY_STORE_CONFIG if is_delay_store(path) else StoreConfig()
    try:
        store = LogStore(path, replace(config, repair=True, background=False))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None
    with store:
        report = store.recovery
        for region in report.repaired:
            click.echo(f"quarantined: {region}")
        if report.truncated_bytes:
            click.echo(f"torn tail cut: {report.truncated_bytes} bytes (kept in {path / 'quarantine'})")
        click.echo(
            f"rebuilt the consume logs, key index and checkpoint from the message log ({report.replayed} records, "
            f"log {store.start_offset}..{store.end_offset}); {len(report.repaired)} damaged regions quarantined"
        )
    after = verify(path)
    click.echo(f"verify after repair: {'OK' if after.ok else 'CORRUPT'}")
    for problem in after.problems:
        click.echo(f"BAD {problem}")
    sys.exit(0 if after.ok else 1)


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
