"""Opening a store after a crash: check the message log, cut a torn tail, refuse on real corruption.

What counts as what:
- a bad record in the active segment with nothing valid after it is a **torn tail** (a write the crash
  interrupted, never acknowledged as durable): it is cut off;
- a bad record with valid records after it, or any bad record in a sealed segment, is **corruption**:
  opening fails with the file and offset, unless `repair` is asked for. Repair never drops a valid
  record: the bad region is copied to `quarantine/` and covered by a blank record of the same size,
  and the derived logs are rebuilt from the message log.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from qmq.store import record as rec
from qmq.store.message_log import MessageLog, scan_segment
from qmq.store.segment import Segment

log = logging.getLogger("qmq.store")


class CorruptStoreError(Exception):
    """The store holds damaged records; it will not open without `repair`."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__(
            "the message log is corrupt:\n  "
            + "\n  ".join(problems)
            + "\nno record was changed; with the server stopped, run `qmq log repair --data-dir DIR` to "
            "quarantine the damaged regions (into DIR/quarantine/) and rebuild the derived files, keeping "
            "every valid record"
        )
        self.problems = problems


@dataclass
class RecoveryReport:
    truncated_bytes: int = 0  # torn tail cut from the active segment
    repaired: list[str] = field(default_factory=list)  # regions quarantined by repair
    replayed: int = 0  # records re-derived after the checkpoint
    scanned_from: int = 0


def scan_for_recovery(
    message_log: MessageLog, start: int, durable_floor: int, *, repair: bool, quarantine: Path, report: RecoveryReport
) -> Iterator[rec.Record]:
    """Valid records from `start` to the end, after fixing what can be fixed (see module docstring).
    Records before `durable_floor` (the checkpoint, or the recovery point if later: recovery_point.py)
    were durable and valid once, so damage there is never taken for a torn tail. Raises
    `CorruptStoreError` on corruption when not repairing."""
    problems: list[str] = []
    segments = message_log.segments
    for i, segment in enumerate(segments):
        if segment.end <= start and i < len(segments) - 1:
            _check_chain(segment, segments[i + 1], problems, repair, quarantine, report)
            continue
        position = max(start, segment.base)
        is_active = i == len(segments) - 1
        while True:
            try:
                for record in scan_segment(segment, position):
                    position = record.end
                    yield record
                break
            except rec.RecordError as exc:
                bad_at = exc.offset
            resume = _next_valid(segment, bad_at)
            if is_active and resume is None and bad_at >= durable_floor:
                cut = segment.end - bad_at
                saved = _save_region(segment, bad_at, segment.end, quarantine, "torn")
                log.warning(
                    "cutting a torn tail of %d bytes from %s at offset %d (kept in %s)",
                    cut,
                    segment.path,
                    bad_at,
                    saved,
                )
                segment.truncate(bad_at - segment.base)
                report.truncated_bytes += cut
                break
            end = resume if resume is not None else segments[i + 1].base if not is_active else segment.end
            where = f"{segment.path} at offset {bad_at} (byte {bad_at - segment.base} of the file)"
            if not repair:
                problems.append(f"{where}: bad record, {end - bad_at} bytes up to the next valid one")
                break
            _quarantine(segment, bad_at, end, quarantine, report, where)
            position = bad_at
        if i < len(segments) - 1:
            _check_chain(segment, segments[i + 1], problems, repair, quarantine, report)
    if problems:
        raise CorruptStoreError(problems)


def _check_chain(
    segment: Segment, following: Segment, problems: list[str], repair: bool, quarantine: Path, report: RecoveryReport
) -> None:
    """A sealed segment must end exactly where the next one begins."""
    if segment.end == following.base:
        return
    where = f"{segment.path} ends at offset {segment.end} but the next segment starts at {following.base}"
    if segment.end > following.base or not repair:
        problems.append(where)
        return
    _quarantine(segment, segment.end, following.base, quarantine, report, where)


def _quarantine(segment: Segment, start: int, end: int, quarantine: Path, report: RecoveryReport, where: str) -> None:
    size = end - start
    if size < rec.HEADER_SIZE:
        raise CorruptStoreError(
            [
                f"{where}: the damaged region is {size} bytes, too small to cover with a "
                f"blank record; restore this segment from a replica or backup"
            ]
        )
    saved = _save_region(segment, start, end, quarantine, "bad")
    blank = rec.encode_blank(size)
    os.pwrite(segment.fd, blank, start - segment.base)
    os.fsync(segment.fd)
    segment.size = max(segment.size, end - segment.base)
    note = f"{where}: {size} bytes quarantined to {saved}"
    log.error("repair: %s", note)
    report.repaired.append(note)


def _save_region(segment: Segment, start: int, end: int, quarantine: Path, kind: str) -> Path:
    """Copy the bytes of [start, end) that exist to quarantine/, so no byte is ever thrown away."""
    quarantine.mkdir(parents=True, exist_ok=True)
    saved = quarantine / f"{segment.path.name}.{start:020d}.{kind}"
    position = start - segment.base
    saved.write_bytes(segment.read(position, max(0, min(end - start, segment.size - position))))
    return saved


def _next_valid(segment: Segment, bad_at: int) -> int | None:
    """Log offset of the first valid record after `bad_at` in `segment`, or None."""
    if segment.size == 0:
        return None
    with mmap.mmap(segment.fd, 0, access=mmap.ACCESS_READ) as mm:
        found = rec.find_next_valid(mm, bad_at - segment.base, segment.base)
    return None if found is None else segment.base + found


def replay(
    records: Iterator[rec.Record],
    from_offset: int,
    derive: Callable[[list[rec.Record]], None],
    report: RecoveryReport,
    batch: int = 4096,
) -> None:
    """Feed every record at or after `from_offset` to `derive`, in batches."""
    pending: list[rec.Record] = []
    for record in records:
        if record.offset < from_offset:
            continue
        pending.append(record)
        if len(pending) >= batch:
            derive(pending)
            report.replayed += len(pending)
            pending = []
    if pending:
        derive(pending)
        report.replayed += len(pending)
