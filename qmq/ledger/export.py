"""`qmq ledger export`: read a store directory and write its ledger; the broker's tables here, the
delay server's in `delay_server/ledger.py` (a `StoreKind` each; `qmq/cli/ledger.py` picks one).

Read-only and safe on a live store (the same reading as `qmq log dump`: no lock taken, nothing
changed, a record being written at the very end is left for the next export). Everything stored
before the moment the export starts (`as_of`, written to `_exports/NAME.json`) is in it, with every
consumer's pulls and acks up to then; the reconciliation's grace period counts from that moment.

The ledger is written by whole UTC days: each day the store holds is rewritten for this store. A
day whose start the store no longer holds (retention removed its first segments) is written only if
the ledger has no file for it yet, so a nightly export is never replaced by a later, shorter one.
Consumer groups are merged with those already in the ledger and those in the broker's snapshot, so
a group whose creation left the journal long ago is still known.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from qmq.broker import snapshot
from qmq.ledger import tables as t
from qmq.ledger.replay import MS_PER_DAY, BrokerLedger, Window, day_of, parse_system_subject
from qmq.ledger.writer import DayFiles, partition_dir, read_file, write_file
from qmq.store.files import write_json
from qmq.store.segment import list_segments
from qmq.store.verify import VerifyReport, iter_records, message_log_dir

SNAPSHOT_DIR = "consumers"  # the broker's state directory in its data directory (qmq/broker/service.py)


@dataclass
class ExportReport:
    name: str
    kind: str  # "broker" or "delay"
    data_dir: str
    as_of: str  # ISO 8601 UTC: everything stored before this is in the export
    as_of_ms: int
    since: str | None
    until: str | None
    records: int = 0
    rows: dict[str, dict[str, int]] = field(default_factory=dict)  # table -> day -> rows written
    kept_days: list[str] = field(default_factory=list)  # days left as an earlier export wrote them
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExportJob:
    """One export under way: the store read, the ledger written, and what is learnt on the way."""

    data_dir: Path
    out: Path
    report: ExportReport
    window: Window
    scan: VerifyReport  # damaged or incomplete records met while reading the message log
    keep: frozenset[str]  # days the store holds only part of: an earlier export of them is kept


@dataclass(frozen=True)
class StoreKind:
    """What kind of store a directory holds, and how its tables are written."""

    name: str  # "broker", "delay": in the export report
    write_tables: Callable[[ExportJob], None]


def window_of(since: datetime | None, until: datetime | None) -> Window:
    """The whole UTC days covering [since, until)."""
    since_ms = None if since is None else int(since.timestamp() * 1000) // MS_PER_DAY * MS_PER_DAY
    until_ms = None if until is None else -(-int(until.timestamp() * 1000) // MS_PER_DAY) * MS_PER_DAY
    return Window(since_ms, until_ms)


def export(
    data_dir: Path,
    out: Path,
    *,
    kind: StoreKind | None = None,
    name: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> ExportReport:
    """Export the store at `data_dir`, a broker's unless `kind` says otherwise, into the ledger at
    `out`; raises FileNotFoundError for a directory that is not a store."""
    kind = kind or BROKER_STORE
    message_log_dir(data_dir)  # a clear error for a directory that is not a store
    window = window_of(since, until)
    as_of_ms = time.time_ns() // 1_000_000
    report = ExportReport(
        name=name or data_dir.resolve().name,
        kind=kind.name,
        data_dir=str(data_dir.resolve()),
        as_of=_iso(as_of_ms),
        as_of_ms=as_of_ms,
        since=_iso(window.since_ms),
        until=_iso(window.until_ms),
    )
    job = ExportJob(data_dir, out, report, window, VerifyReport(), _partial_day(data_dir))
    kind.write_tables(job)
    report.notes += job.scan.notes
    report.problems += job.scan.problems
    exports = out / t.EXPORTS_DIR
    exports.mkdir(parents=True, exist_ok=True)
    write_json(exports / f"{report.name}.json", asdict(report), indent=2)
    return report


def _export_broker(job: ExportJob) -> None:
    report, out = job.report, job.out
    messages = DayFiles(out, t.MESSAGES, report.name, "first_stored_at", job.keep)
    deliveries = DayFiles(out, t.DELIVERIES, report.name, "first_stored_at", job.keep)
    try:
        ledger = BrokerLedger(job.window, on_message=messages.add)
        ledger.feed_all(iter_records(job.data_dir, job.scan))
        deliveries.add_all(ledger.delivery_rows())
        report.rows[t.MESSAGES] = messages.commit()
        report.rows[t.DELIVERIES] = deliveries.commit()
        report.kept_days = sorted(messages.kept | deliveries.kept)
    finally:
        messages.abort()
        deliveries.abort()
    report.records = ledger.records
    report.problems += ledger.problems
    groups_path = partition_dir(out, t.GROUPS, report.name) / t.PART_FILE
    groups = merge_groups(ledger.group_rows, _snapshot_groups(job.data_dir, report), read_file(groups_path))
    write_file(groups_path, t.GROUPS, groups)
    report.rows[t.GROUPS] = {"all": len(groups)}


BROKER_STORE = StoreKind("broker", _export_broker)


def _partial_day(data_dir: Path) -> frozenset[str]:
    """The first day of a store whose oldest segments were removed by retention: it holds only part
    of that day."""
    segments = list_segments(message_log_dir(data_dir))
    if not segments or segments[0][0] == 0:
        return frozenset()
    for record in iter_records(data_dir):
        return frozenset({day_of(record.store_ts)})
    return frozenset()


def _snapshot_groups(data_dir: Path, report: ExportReport) -> list[dict[str, Any]]:
    """The consumer groups in the broker's last snapshot (their creation time is not kept there)."""
    try:
        state = snapshot.load(data_dir / SNAPSHOT_DIR)
    except (snapshot.SnapshotError, OSError, ValueError) as exc:
        report.notes.append(f"consumer snapshot not read ({exc}); groups come from the journal only")
        return []
    rows = []
    for group in (state or {}).get("groups", []):
        if parse_system_subject(group["subject"]) is None:
            rows.append(
                {
                    "subject": group["subject"],
                    "group": group["group"],
                    "broadcast": bool(group["broadcast"]),
                    "created_at": None,
                    "start_seq": None,
                }
            )
    return rows


def merge_groups(*sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (subject, group): the earliest known creation (unknown only if none is known)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for rows in sources:
        for row in rows:
            key = (row["subject"], row["group"])
            old = merged.get(key)
            if old is None or (
                row["created_at"] is not None and (old["created_at"] is None or row["created_at"] < old["created_at"])
            ):
                merged[key] = dict(row)
    return sorted(merged.values(), key=lambda r: (r["subject"], r["group"]))


def _iso(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
