"""Read-only checks and dumps of a store directory, safe on a live store (`qmq log verify/dump`).

Nothing here takes the store's lock or changes a byte. A record still being written at the very end of
the newest segment is reported as "in progress", not as damage.
"""

from __future__ import annotations

import base64
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from qmq.store import checkpoint as ckpt
from qmq.store import record as rec
from qmq.store.consume_log import ENTRY, ENTRY_MAGIC, ENTRY_SIZE
from qmq.store.segment import list_segments

MAX_PROBLEMS = 1000


@dataclass
class VerifyReport:
    records: int = 0
    blank_records: int = 0
    segments: int = 0
    consume_entries: int = 0
    checked_files: int = 0  # checkpoints and snapshots read and found whole
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _ReadOnlySegment:
    def __init__(self, base: int, path: Path) -> None:
        self.base = base
        self.path = path
        self.size = path.stat().st_size

    def read_all(self) -> bytes | mmap.mmap:
        if self.size == 0:
            return b""
        with open(self.path, "rb") as f:
            return mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_READ)


def message_log_dir(data_dir: Path) -> Path:
    path = data_dir / "messagelog"
    if not path.is_dir():
        raise FileNotFoundError(f"{data_dir} is not a qmq store (no messagelog/ directory)")
    return path


def iter_records(data_dir: Path, report: VerifyReport | None = None) -> Iterator[rec.Record]:
    """Every readable record in log order. Bad regions are skipped (to the next valid record) and, when
    a report is given, named in it with file and offset."""
    report = report or VerifyReport()
    segments = [_ReadOnlySegment(b, p) for b, p in list_segments(message_log_dir(data_dir))]
    for i, segment in enumerate(segments):
        report.segments += 1
        last = i == len(segments) - 1
        buf = segment.read_all()
        pos = 0
        try:
            while pos < len(buf):
                try:
                    record = rec.decode(buf, pos, segment.base)
                except rec.RecordError as exc:
                    resume = rec.find_next_valid(buf, pos, segment.base)
                    if isinstance(exc, rec.TruncatedRecord) and last and resume is None:
                        report.notes.append(
                            f"{segment.path}: {len(buf) - pos} bytes at offset {exc.offset} "
                            f"are an incomplete record (being written, or a torn tail that "
                            f"opening the store will cut)"
                        )
                        break
                    report.problems.append(
                        f"{segment.path}: bad record at offset {exc.offset} (byte {pos} of the file): {exc.reason}"
                    )
                    if len(report.problems) >= MAX_PROBLEMS or resume is None:
                        break
                    pos = resume
                    continue
                if record.is_blank:
                    report.blank_records += 1
                else:
                    report.records += 1
                    yield record
                pos += record.size
        finally:
            if isinstance(buf, mmap.mmap):
                buf.close()
        if not last and segment.base + segment.size != segments[i + 1].base:
            report.problems.append(
                f"{segment.path}: ends at offset {segment.base + segment.size} but the next "
                f"segment starts at {segments[i + 1].base}"
            )


def verify(data_dir: Path) -> VerifyReport:
    """CRC-check every record, then check every consume-log entry points at the record it claims."""
    report = VerifyReport()
    by_offset: dict[int, tuple[str, int, int]] = {}
    for record in iter_records(data_dir, report):
        by_offset[record.offset] = (record.subject, record.seq, record.size)
    log_start = min(by_offset, default=0)
    log_end = max((o + v[2] for o, v in by_offset.items()), default=0)
    consume_dir = data_dir / "consumelog"
    beyond: list[tuple[str, int]] = []  # entries past the log as read: written since, or damaged
    if consume_dir.is_dir():
        for subject_dir in sorted(consume_dir.iterdir()):
            _verify_consume_log(subject_dir, by_offset, log_start, log_end, report, beyond)
    segments = list_segments(message_log_dir(data_dir))
    live_end = segments[-1][0] + segments[-1][1].stat().st_size if segments else 0
    for where, offset in beyond:
        if offset >= live_end:
            report.problems.append(f"{where}: points at offset {offset}, past the end of the log ({live_end})")
    _verify_checkpoint(data_dir, by_offset, report)
    return report


def _verify_checkpoint(data_dir: Path, by_offset: dict, report: VerifyReport) -> None:
    """The checkpoint's CRC, and its claims against the records: no subject has a record before its
    offset with a sequence it does not count (a checkpoint may count more: sequences of records
    quarantined or removed stay counted). Opening the store discards a bad checkpoint and rebuilds."""
    directory = data_dir / "checkpoint"
    try:
        checkpoint = ckpt.load(directory)
    except ckpt.CheckpointError as exc:
        report.problems.append(str(exc))
        return
    if checkpoint is None:
        return
    where = directory / ckpt.FILE_NAME
    before: dict[str, int] = {}  # subject -> highest seq of a record before the checkpoint's offset
    for offset, (subject, seq, _size) in by_offset.items():
        if offset < checkpoint.offset and seq > before.get(subject, -1):
            before[subject] = seq
    for subject, highest in sorted(before.items()):
        claimed = checkpoint.next_seq.get(subject, 0)
        if highest >= claimed:
            report.problems.append(
                f"{where}: says {subject!r} holds {claimed} messages before offset {checkpoint.offset}, "
                f"the log has seq {highest} there"
            )
    report.checked_files += 1


def _verify_consume_log(
    subject_dir: Path,
    by_offset: dict,
    log_start: int,
    log_end: int,
    report: VerifyReport,
    beyond: list[tuple[str, int]],
) -> None:
    subject = subject_dir.name
    for base, path in list_segments(subject_dir):
        data = path.read_bytes()
        for i in range(len(data) // ENTRY_SIZE):
            magic, _attr, _r, size, offset, _mask, _ts = ENTRY.unpack_from(data, i * ENTRY_SIZE)
            if magic == 0:
                continue  # a hole
            seq = base + i
            where = f"{path}: entry for seq {seq}"
            if magic != ENTRY_MAGIC:
                report.problems.append(f"{where}: bad entry magic {magic:#06x}")
                continue
            report.consume_entries += 1
            if offset < log_start:
                continue  # removed by retention
            if offset >= log_end:
                beyond.append((where, offset))
                continue
            found = by_offset.get(offset)
            if found is None:
                report.problems.append(f"{where}: points at offset {offset}, where no record starts")
            elif found != (subject, seq, size):
                report.problems.append(
                    f"{where}: points at offset {offset}, which holds {found[0]!r} seq {found[1]} ({found[2]} bytes)"
                )
            if len(report.problems) >= MAX_PROBLEMS:
                return


def record_to_json(record: rec.Record) -> dict:
    out = {
        "offset": record.offset,
        "size": record.size,
        "subject": record.subject,
        "seq": record.seq,
        "message_id": record.message_id,
        "key": record.key,
        "tags": list(record.tags),
        "flags": record.flags,
        "store_ts": record.store_ts,
    }
    try:
        out["payload"] = record.payload.decode()
    except UnicodeDecodeError:
        out["payload_base64"] = base64.b64encode(record.payload).decode()
    return out
