"""Rebuilding one derived file from the message log while the store is open: a consume log whose
entry points at the wrong record (or at none), or the key index when one of its entries does.

Derived data is never trusted over the message log: a reader that finds an entry naming a record
other than the one it points at rebuilds that subject's consume log (or the index) and reads again,
so a flipped byte costs one scan of the log, never a skipped message or an error for ever. The scan
is tolerant: a damaged region of the message log is stepped over (and reported by the reader that
meets it), so one bad record does not stop the rebuild of everything after it.
"""

from __future__ import annotations

import logging
import mmap
import shutil
from collections.abc import Iterator
from pathlib import Path

from qmq.store import record as rec
from qmq.store.consume_log import ConsumeLog, pack_entry
from qmq.store.index import KeyIndex
from qmq.store.message_log import MessageLog

log = logging.getLogger("qmq.store")

INDEX_BATCH = 4096  # index pairs added at a time during a rebuild


def readable_records(message_log: MessageLog, blanks: bool = False) -> Iterator[rec.Record]:
    """Every record of the message log that passes its CRC, in log order, stepping over bad regions;
    blank records too with `blanks`."""
    for segment in list(message_log.segments):
        if segment.size == 0:
            continue
        with mmap.mmap(segment.fd, segment.size, access=mmap.ACCESS_READ) as data:
            yield from _readable_in(data, segment.base, blanks)


def _readable_in(data: mmap.mmap, base: int, blanks: bool) -> Iterator[rec.Record]:
    pos = 0
    while pos < len(data):
        try:
            record = rec.decode(data, pos, base)
        except rec.RecordError:
            resume = rec.find_next_valid(data, pos, base)
            if resume is None:
                return
            pos = resume
            continue
        if blanks or not record.is_blank:
            yield record
        pos += record.size


def rebuild_consume_log(message_log: MessageLog, directory: Path, subject: str, entries_per_segment: int) -> ConsumeLog:
    """A new consume log for `subject` in `directory` (the old one is deleted), from the message log."""
    shutil.rmtree(directory, ignore_errors=True)
    consume_log = ConsumeLog(directory, entries_per_segment)
    written = 0
    for r in readable_records(message_log, blanks=True):
        if r.is_blank:  # messages cut out as damaged keep their sequences, pointing at the blank
            for seq in (seq for lost, seq in rec.lost_messages(r) if lost == subject):
                consume_log.write(seq, pack_entry(r.offset, r.size, 0, r.store_ts))
                written += 1
        elif r.subject == subject:
            consume_log.write(r.seq, pack_entry(r.offset, r.size, rec.tag_mask(r.tags) if r.tags else 0, r.store_ts))
            written += 1
    log.warning("consume log of %r rebuilt from the message log: %d entries", subject, written)
    return consume_log


def rebuild_index(message_log: MessageLog, directory: Path, slots: int, capacity: int) -> KeyIndex:
    """A new key index in `directory` (the old files are deleted), from the message log."""
    shutil.rmtree(directory, ignore_errors=True)
    index = KeyIndex(directory, slots, capacity)
    pairs: list[tuple[int, int]] = []
    for r in readable_records(message_log):
        pairs.append((rec.key_hash(r.message_id.encode()), r.offset))
        if r.key:
            pairs.append((rec.key_hash(r.key.encode(), r.subject.encode()), r.offset))
        if len(pairs) >= INDEX_BATCH:
            index.add(pairs)
            pairs = []
    if pairs:
        index.add(pairs)
    log.warning("key index rebuilt from the message log")
    return index
