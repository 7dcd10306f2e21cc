"""Read-only checks and dumps of a delay server's own files, for `qmq log verify/dump` (the message
log beside them is checked by `qmq.store.verify` like a broker's).

Checked: every bucket's records (CRC) against its index (one entry per record, same position, size,
message-log offset and due time, due within the bucket); every dispatch-log entry (CRC, names a
message of its bucket); every cancel record (CRC). Safe on a live server: an entry or record being
written at the very end of a file is a note, not damage.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from delay_server import dispatch_log, records
from delay_server.cancels import SUFFIX as CANCELS_SUFFIX
from delay_server.schedule_log import (
    INDEX_HEAD,
    INDEX_SIZE,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SETTINGS_FILE,
    parse_bucket_name,
)
from qmq.store import checksum
from qmq.store import record as rec
from qmq.store.verify import VerifyReport

MAX_PROBLEMS = 1000


def is_delay_store(data_dir: Path) -> bool:
    return (data_dir / "schedule" / SETTINGS_FILE).exists()


@dataclass
class DelayCounts:
    buckets: int = 0
    scheduled: int = 0  # message copies in the buckets
    dispatched: int = 0  # dispatch-log entries
    cancels: int = 0


def _bucket_minutes(data_dir: Path) -> int:
    return int(json.loads((data_dir / "schedule" / SETTINGS_FILE).read_text())["bucket_minutes"])


def _records(path: Path, report: VerifyReport) -> list[rec.Record]:
    found, error = records.read_file(path)
    if isinstance(error, rec.TruncatedRecord):
        report.notes.append(
            f"{path}: an incomplete record at position {error.offset} (being written, or a torn "
            f"tail that the next start cuts)"
        )
    elif error is not None:
        report.problems.append(f"{path}: bad record at position {error.offset}: {error.reason}")
    return found


def verify_delay_files(data_dir: Path, report: VerifyReport) -> DelayCounts:
    """Check the schedule log, dispatch logs and cancels of `data_dir`; problems go to `report`."""
    counts = DelayCounts()
    schedule_dir = data_dir / "schedule"
    bucket_ms = _bucket_minutes(data_dir) * 60_000
    offsets_by_bucket: dict[str, set[int]] = {}
    for path in sorted(schedule_dir.glob("*" + LOG_SUFFIX)):
        name = path.name[: -len(LOG_SUFFIX)]
        start = parse_bucket_name(name)
        if start is None:
            continue
        offsets_by_bucket[name] = _verify_bucket(
            path, schedule_dir / (name + INDEX_SUFFIX), start, bucket_ms, report, counts
        )
    for path in sorted((data_dir / "dispatch").glob("*" + dispatch_log.SUFFIX)):
        name = path.name[: -len(dispatch_log.SUFFIX)]
        positions, bad = dispatch_log.read_entries(path)
        counts.dispatched += len(positions)
        if bad:
            report.problems.append(f"{path}: {bad} damaged entries")
        if path.stat().st_size % dispatch_log.ENTRY_SIZE:
            report.notes.append(f"{path}: an incomplete entry at the end (being written, or a torn write)")
        known = offsets_by_bucket.get(name)
        if known is None:
            report.problems.append(f"{path}: no bucket {name} in the schedule log")
            continue
        for position in positions:
            if position not in known:
                report.problems.append(f"{path}: names position {position}, where no message of bucket {name} starts")
                break
    for path in sorted((data_dir / "cancels").glob("*" + CANCELS_SUFFIX)):
        for record in _records(path, report):
            counts.cancels += 1
            if not record.flags & records.CANCEL:
                report.problems.append(f"{path}: record at position {record.offset} is not a cancel")
    del report.problems[MAX_PROBLEMS:]
    return counts


def _verify_bucket(
    log_path: Path, index_path: Path, start: int, bucket_ms: int, report: VerifyReport, counts: DelayCounts
) -> set[int]:
    found = {r.offset: r for r in _records(log_path, report)}  # by position in the .log file
    counts.buckets += 1
    counts.scheduled += len(found)
    data = index_path.read_bytes() if index_path.exists() else b""
    positions: set[int] = set()
    last_offset = -1
    count = len(data) // INDEX_SIZE
    if len(data) % INDEX_SIZE:
        report.notes.append(f"{index_path}: an incomplete entry at the end (being written, or a torn write)")
    for i in range(count):
        at = i * INDEX_SIZE
        offset, position, due_ms, size = INDEX_HEAD.unpack_from(data, at)
        where = f"{index_path}: entry {i}"
        if checksum.crc32(data[at : at + INDEX_HEAD.size]) != int.from_bytes(
            data[at + INDEX_HEAD.size : at + INDEX_SIZE]
        ):
            report.problems.append(f"{where}: CRC mismatch")
            continue
        record = found.get(position)
        if record is None:
            report.problems.append(f"{where}: no record starts at position {position} of {log_path.name}")
        elif record.size != size or records.due_of(record.payload) != due_ms or not record.flags & records.DELAYED:
            report.problems.append(f"{where}: does not match the record at position {position}")
        elif not start <= due_ms < start + bucket_ms:
            report.problems.append(f"{where}: due {_iso(due_ms)} is outside the bucket")
        if offset <= last_offset:
            report.problems.append(f"{where}: message-log offset {offset} does not follow {last_offset}")
        last_offset = offset
        positions.add(position)
    if count < len(found):
        report.problems.append(f"{index_path}: {len(found) - count} records of {log_path.name} have no entry")
    return positions


def iter_scheduled(data_dir: Path) -> Iterator[tuple[str, rec.Record]]:
    """(bucket name, record copy) for every message in the schedule log, bucket by bucket."""
    report = VerifyReport()
    for path in sorted((data_dir / "schedule").glob("*" + LOG_SUFFIX)):
        name = path.name[: -len(LOG_SUFFIX)]
        if parse_bucket_name(name) is not None:
            for record in _records(path, report):
                yield name, record


def delayed_to_json(record: rec.Record) -> dict:
    """A delayed message or cancel as `qmq log dump` prints it: the due time, and the producer's
    payload without the due-time prefix."""
    due = records.due_of(record.payload) if len(record.payload) >= records.DUE.size else None
    body = records.body_of(record.payload)
    out: dict = {"due_at" if record.flags & records.DELAYED else "keep_until": _iso(due) if due is not None else None}
    try:
        out["payload"] = body.decode()
    except UnicodeDecodeError:
        out["payload_base64"] = base64.b64encode(body).decode()
    return out


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
