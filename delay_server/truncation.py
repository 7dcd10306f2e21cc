"""A delay server's own files cut back with its message log (docs/replication.md): a deposed master
rejoins its group as a replica and cuts what it wrote past the new master's log
(`qmq.store.replication.truncate_log`); everything a delay server derived from those records must go
too, or a promoted replica would later fire a message the group never acknowledged, or skip one for a
cancel that was never acknowledged.

`cut_back(data_dir, offset)`, on closed files: every bucket loses its entries (and copies) of
message-log offsets at or past `offset` (a bucket is appended in log order, so they are its tail);
every dispatch entry naming a position that was cut goes; every cancel whose record lies at or past
`offset` goes; the schedule checkpoint is moved back to `offset`. Positions a replay gives again are
those of the same records, so what stays in a dispatch log keeps naming the right message.
"""

from __future__ import annotations

import logging
from pathlib import Path

from delay_server import records
from delay_server.cancels import SUFFIX as CANCELS_SUFFIX
from delay_server.dispatch_log import SUFFIX as DISPATCH_SUFFIX
from delay_server.dispatch_log import pack_entry, read_entries
from delay_server.schedule_log import LOG_SUFFIX, Bucket, ScheduleLog, bucket_name, parse_bucket_name
from qmq.store.files import write_atomically

log = logging.getLogger("qmq.delay")


def cut_back(data_dir: Path, offset: int, bucket_minutes: int) -> int:
    """Cut the schedule, dispatch logs and cancels of the (closed) delay server in `data_dir` back
    to message-log `offset`; how many bucket entries and cancels went."""
    schedule_dir, dispatch_dir, cancels_dir = data_dir / "schedule", data_dir / "dispatch", data_dir / "cancels"
    dropped = 0
    for path in sorted(schedule_dir.glob("*" + LOG_SUFFIX)):
        start = parse_bucket_name(path.name[: -len(LOG_SUFFIX)])
        if start is None:
            continue
        bucket = Bucket(schedule_dir, start)
        try:
            cut = bucket.cut_from(offset)
            kept_size = bucket.log_size
        finally:
            bucket.close()
        if cut:
            dropped += cut
            _keep_dispatched_below(dispatch_dir / (bucket_name(start) + DISPATCH_SUFFIX), kept_size)
    for path in sorted(cancels_dir.glob("*" + CANCELS_SUFFIX)):
        found, _error = records.read_file(path)  # a record's offset is its place in the file
        kept = [r for r in found if r.seq < offset]  # a cancel's seq is its message-log offset
        if len(kept) != len(found):
            dropped += len(found) - len(kept)
            data = path.read_bytes()
            write_atomically(path, b"".join(data[r.offset : r.offset + r.size] for r in kept))
    schedule = ScheduleLog(schedule_dir, bucket_minutes)
    try:
        if schedule.checkpoint_offset > offset:
            schedule.save_checkpoint(offset, [])
    finally:
        schedule.close()
    if dropped:
        log.warning("delay server: %d bucket entries and cancels past offset %d cut with the log", dropped, offset)
    return dropped


def _keep_dispatched_below(path: Path, size: int) -> None:
    positions, _bad = read_entries(path)
    kept = [p for p in positions if p < size]
    if len(kept) != len(positions):
        write_atomically(path, b"".join(map(pack_entry, kept)))
