"""The message log: every message of every subject, appended once, in segments.

The message log is the only source of truth in a store; consume logs and the key index are derived
from it and can be rebuilt. A record never spans two segments: a segment rolls when the next record
would not fit, and the next segment's base is the previous segment's end, so offsets are continuous.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from itertools import accumulate
from pathlib import Path

from qmq.store import record as rec
from qmq.store.files import fsync_dir
from qmq.store.segment import Segment, list_segments

log = logging.getLogger("qmq.store")

DEFAULT_SEGMENT_BYTES = 1024 * 1024 * 1024
SCAN_CHUNK_BYTES = 8 * 1024 * 1024


class MessageLog:
    """Segments of the message log. `append` is called by one writer at a time (the store's lock);
    `read` may be called from any thread."""

    def __init__(self, directory: Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self.segments: list[Segment] = [Segment(directory, base) for base, _ in list_segments(directory)]
        if not self.segments:
            self.segments.append(Segment(directory, 0, create=True))
        self._bases = [s.base for s in self.segments]
        self._unsynced: list[Segment] = []  # sealed segments not yet fsynced
        self._lock = threading.Lock()  # guards the segment list against the flusher and cleaner

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    @property
    def start_offset(self) -> int:
        return self.segments[0].base

    @property
    def end_offset(self) -> int:
        return self.segments[-1].end

    def append(self, records: Sequence[bytes]) -> list[int]:
        """Append encoded records; returns the offset of each. Not durable until `sync` covers it."""
        if not records:
            return []
        active = self.active
        if active.size + sum(map(len, records)) <= self.segment_bytes:
            offsets = list(accumulate(map(len, records[:-1]), initial=active.end))
            active.append(b"".join(records))
            return offsets
        offsets = []
        for data in records:  # rolls somewhere in this batch
            if active.size + len(data) > self.segment_bytes and active.size > 0:
                active = self._roll()
            offsets.append(active.end)
            active.append(data)
        return offsets

    def append_chunk(self, data: bytes, sizes: Sequence[int]) -> None:
        """Append records given as one buffer and their sizes (a replicated chunk): one write when
        they fit the active segment, else rolled at the same record as `append` would."""
        active = self.active
        if active.size + len(data) <= self.segment_bytes or not data:
            active.append(data)
            return
        view, start, position = memoryview(data), 0, 0
        for size in sizes:
            pending = position - start  # bytes of this chunk bound for the active segment, not yet written
            if active.size + pending + size > self.segment_bytes and active.size + pending > 0:
                if pending:
                    active.append(view[start:position])
                active, start = self._roll(), position
            position += size
        if position > start:
            active.append(view[start:position])

    def undo_append(self, end: int) -> None:
        """Forget every byte at or after `end` (the end before a failed `append`): segments rolled
        since are deleted, the active one cut back. Cutting needs no free space."""
        while len(self.segments) > 1 and self.active.base >= end and self.active.base > self.segments[0].base:
            with self._lock:
                segment = self.segments.pop()
                self._bases.pop()
                if segment in self._unsynced:
                    self._unsynced.remove(segment)
            segment.close()
            segment.path.unlink(missing_ok=True)
        with self._lock:
            if self.active in self._unsynced:
                self._unsynced.remove(self.active)
        active = self.active
        os.ftruncate(active.fd, end - active.base)
        active.size = end - active.base

    def _roll(self) -> Segment:
        sealed = self.active
        new = Segment(self.directory, sealed.end, create=True)
        with self._lock:
            self._unsynced.append(sealed)
            self.segments.append(new)
            self._bases.append(new.base)
        log.info("message log rolled to segment %s", new.path.name)
        return new

    def sync(self) -> int:
        """Make everything appended so far durable; returns the offset it is durable up to."""
        with self._lock:
            end = self.end_offset
            todo = [*self._unsynced, self.active]
            self._unsynced = []
        for segment in todo:
            segment.sync()
        return end

    def sync_files(self) -> tuple[int, list[int]]:
        """The end appended so far and the descriptors of the files an fsync must cover for it: the
        segments sealed since the last `sync` (or `synced_to`), then the active one. For an fsync
        run elsewhere (the C flusher thread, qmq/store/_sync_thread.pyx)."""
        with self._lock:
            return self.end_offset, [segment.fd for segment in (*self._unsynced, self.active)]

    def synced_to(self, end: int) -> None:
        """An fsync run elsewhere covered everything before `end`: the sealed segments before it
        need none any more."""
        with self._lock:
            if self._unsynced:
                self._unsynced = [segment for segment in self._unsynced if segment.end > end]

    def segment_for(self, offset: int) -> Segment | None:
        with self._lock:
            i = bisect.bisect_right(self._bases, offset) - 1
            if i < 0:
                return None
            segment = self.segments[i]
        return segment if offset < segment.end else None

    def damage_end(self, offset: int) -> int:
        """Where readable records resume after damage at `offset`: the next record that passes its
        CRC in the same segment, or the segment's end."""
        segment = self.segment_for(offset)
        if segment is None:
            return offset + 1
        with mmap.mmap(segment.fd, segment.size, access=mmap.ACCESS_READ) as data:
            resume = rec.find_next_valid(data, offset - segment.base, segment.base)
        return segment.base + (resume if resume is not None else segment.size)

    def read_record(self, offset: int, size_hint: int = 4096) -> rec.Record:
        """The record at `offset`, checked against its CRC. Raises `RecordError` naming the offset."""
        segment = self.segment_for(offset)
        if segment is None:
            raise rec.RecordError(
                offset, f"no segment holds offset {offset} (log is {self.start_offset}..{self.end_offset})"
            )
        position = offset - segment.base
        buf = segment.read(position, size_hint)
        try:
            return rec.decode(buf, 0, offset)
        except rec.TruncatedRecord:
            if len(buf) < rec.HEADER_SIZE:
                raise
            size = rec.PREFIX.unpack_from(buf, 0)[0]
            return rec.decode(segment.read(position, size), 0, offset)
        except rec.RecordError as exc:
            raise rec.RecordError(offset, f"{segment.path}: {exc.reason}") from None

    def read_records(self, spans: list[tuple[int, int]]) -> list[rec.Record]:
        """The records at `spans` of (offset, size), CRC-checked. Records that lie back to back in one
        segment (the usual case for a subject read in order) are read with one system call."""
        out: list[rec.Record] = []
        i = 0
        while i < len(spans):
            start, size = spans[i]
            segment = self.segment_for(start)
            if segment is None:
                raise rec.RecordError(
                    start, f"no segment holds offset {start} (log is {self.start_offset}..{self.end_offset})"
                )
            j, end = i + 1, start + size
            while j < len(spans) and spans[j][0] == end and end + spans[j][1] <= segment.end:
                end += spans[j][1]
                j += 1
            buf = segment.read(start - segment.base, end - start)
            for offset, _size in spans[i:j]:
                try:
                    out.append(rec.decode(buf, offset - start, start))
                except rec.RecordError as exc:
                    raise rec.RecordError(offset, f"{segment.path}: {exc.reason}") from None
            i = j
        return out

    def read_bytes(self, start: int, end: int) -> bytes:
        """The log's bytes from `start` to `end`, both record boundaries: whole records, as written
        (a record never spans segments, a range may)."""
        segment = self.segment_for(start)
        if segment is not None and end <= segment.end:
            return segment.read(start - segment.base, end - start)
        chunks = []
        while start < end:
            segment = self.segment_for(start)
            if segment is None:
                raise rec.RecordError(start, f"no segment holds offset {start}")
            upto = min(end, segment.end)
            chunks.append(segment.read(start - segment.base, upto - start))
            start = upto
        return b"".join(chunks)

    def scan(self, start: int) -> Iterator[rec.Record]:
        """Every record from offset `start` (a record boundary) to the end, CRC-checked."""
        with self._lock:
            segments = list(self.segments)
        for segment in segments:
            if segment.end > start:
                yield from scan_segment(segment, max(start, segment.base))

    def remove_segments_before(self, offset: int) -> list[Segment]:
        """Drop (and delete) whole segments that end at or before `offset`; never the active one."""
        removed = []
        with self._lock:
            while len(self.segments) > 1 and self.segments[0].end <= offset:
                segment = self.segments.pop(0)
                self._bases.pop(0)
                removed.append(segment)
            self._unsynced = [s for s in self._unsynced if s not in removed]
        for segment in removed:
            segment.close()
            segment.path.unlink(missing_ok=True)
        if removed:
            fsync_dir(self.directory)
        return removed

    def close(self) -> None:
        for segment in self.segments:
            segment.close()


def scan_segment(segment: Segment, start: int, end: int | None = None) -> Iterator[rec.Record]:
    """Records of one segment from log offset `start`; raises `RecordError` at the first bad one
    (`TruncatedRecord` when the segment ends inside a record)."""
    position = start - segment.base
    limit = segment.size if end is None else min(segment.size, end - segment.base)
    buf = b""
    buf_start = position
    while position < limit:
        try:
            record = rec.decode(buf, position - buf_start, segment.base + buf_start)
        except rec.TruncatedRecord:
            if buf_start + len(buf) >= limit:
                raise
            need = SCAN_CHUNK_BYTES
            if buf_start + len(buf) - position >= rec.PREFIX.size:
                need = max(need, rec.PREFIX.unpack_from(buf, position - buf_start)[0])
            buf = segment.read(position, min(need, limit - position))
            buf_start = position
            continue
        yield record
        position += record.size
