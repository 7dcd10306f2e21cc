"""The consume log of one subject: a fixed-size entry per message, addressed by the subject's sequence.

Entry `seq` lives at byte `(seq - base) * ENTRY_SIZE` of the segment whose base sequence is `base`, so a
consumer's position is just a number and reading the next N messages is one read. Everything here is
derived from the message log; the store rewrites it on recovery, so it is never fsynced on the
append path, only before a checkpoint.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import NamedTuple

from qmq.store.segment import list_segments, segment_name

ENTRY = struct.Struct(">HBBIQQQ")  # magic, attr, reserved, size, offset, tag_mask, store_ts
ENTRY_SIZE = ENTRY.size  # 32
ENTRY_MAGIC = 0xC10C
DEFAULT_ENTRIES_PER_SEGMENT = 1 << 20  # 32 MiB per segment


class DamagedEntry(ValueError):
    """An entry that is neither a valid entry nor a hole (all zeros): the file must be rebuilt."""


_new_tuple = tuple.__new__


class Entry(NamedTuple):
    seq: int
    offset: int  # of the record in the message log
    size: int
    tag_mask: int
    store_ts: int


def pack_entry(offset: int, size: int, tag_mask: int, store_ts: int) -> bytes:
    return ENTRY.pack(ENTRY_MAGIC, 0, 0, size, offset, tag_mask, store_ts)


class ConsumeLog:
    """Entries of one subject. One writer (the store), many readers."""

    def __init__(self, directory: Path, entries_per_segment: int = DEFAULT_ENTRIES_PER_SEGMENT) -> None:
        self.directory = directory
        self.entries_per_segment = entries_per_segment
        # Directories whose new entries (this subject's directory, a new segment) the next checkpoint
        # makes durable: a crash before it replays the records into them again, so a send need not wait.
        # At open, this directory and its parent always: what a killed process made is visible again but
        # may not be durable yet (fsyncing a directory with nothing new costs next to nothing).
        self._new_in: set[Path] = {directory, directory.parent}
        made = directory
        while not made.is_dir():  # any parent it needs
            self._new_in.add(made.parent)
            made = made.parent
        directory.mkdir(parents=True, exist_ok=True)
        self._fds: dict[int, int] = {base: os.open(path, os.O_RDWR) for base, path in list_segments(directory)}
        self.dirty: set[int] = set()  # segment bases written since the last checkpoint

    @property
    def first_seq(self) -> int:
        """The lowest sequence still kept (retention removes whole segments from the front)."""
        return min(self._fds, default=0)

    def _fd(self, base: int) -> int:
        fd = self._fds.get(base)
        if fd is None:
            fd = os.open(self.directory / segment_name(base), os.O_RDWR | os.O_CREAT, 0o644)
            self._fds[base] = fd
            self._new_in.add(self.directory)
        return fd

    def write(self, seq: int, entries: bytes) -> None:
        """Write packed entries for `seq`, `seq + 1`, ...; rewriting an entry with the same bytes is
        harmless, which makes replay idempotent."""
        per = self.entries_per_segment
        base = seq - seq % per
        if seq + len(entries) // ENTRY_SIZE <= base + per:  # the common case: one segment
            os.pwrite(self._fds.get(base) or self._fd(base), entries, (seq - base) * ENTRY_SIZE)
            self.dirty.add(base)
            return
        view = memoryview(entries)
        while view:
            base = seq - seq % per
            room = (base + per - seq) * ENTRY_SIZE
            chunk = view[:room]
            os.pwrite(self._fd(base), chunk, (seq - base) * ENTRY_SIZE)
            self.dirty.add(base)
            seq += len(chunk) // ENTRY_SIZE
            view = view[room:]

    def read(self, seq: int, count: int) -> list[Entry | None]:
        """Up to `count` entries from `seq` within one segment; None marks a hole (never written, or cut
        by repair: all zeros). Fewer entries come back at a segment or file end. `DamagedEntry` for
        anything else (the store rebuilds the file from the message log)."""
        per = self.entries_per_segment
        base = seq - seq % per
        fd = self._fds.get(base)
        if fd is None:
            return []
        count = min(count, base + per - seq)
        data = os.pread(fd, count * ENTRY_SIZE, (seq - base) * ENTRY_SIZE)
        data = data[: len(data) - len(data) % ENTRY_SIZE]
        out: list[Entry | None] = []
        for i, (magic, _attr, _r, size, offset, mask, ts) in enumerate(ENTRY.iter_unpack(data)):
            if magic == ENTRY_MAGIC:
                out.append(_new_tuple(Entry, (seq + i, offset, size, mask, ts)))  # Entry(...) costs more
            elif magic == 0 and not any(data[i * ENTRY_SIZE : (i + 1) * ENTRY_SIZE]):
                out.append(None)
            else:
                raise DamagedEntry(f"{self.directory / segment_name(base)}: entry for seq {seq + i} is damaged")
        return out

    def end_seq(self) -> int:
        """One past the highest sequence written (0 if none)."""
        return max((base + os.fstat(fd).st_size // ENTRY_SIZE for base, fd in self._fds.items()), default=0)

    def last_entry_of(self, base: int) -> Entry | None:
        size = os.fstat(self._fds[base]).st_size
        n = size // ENTRY_SIZE
        if n == 0:
            return None
        found = self.read(base + n - 1, 1)
        return found[0] if found else None

    def truncate(self, next_seq: int) -> None:
        """Forget every entry at or after `next_seq` (the message log no longer holds those records)."""
        keep = next_seq - next_seq % self.entries_per_segment
        for base in sorted(self._fds):
            if base == keep:
                os.ftruncate(self._fds[base], (next_seq - base) * ENTRY_SIZE)
            elif base > keep:
                self._remove(base)

    def remove_segments_before(self, min_offset: int, next_seq: int) -> int:
        """Delete whole segments whose every entry points below `min_offset`; keeps the segment that
        `next_seq` writes into. Returns how many were removed."""
        removed = 0
        per = self.entries_per_segment
        for base in sorted(self._fds):
            if base + per > next_seq:
                break
            last = self.last_entry_of(base)
            if last is not None and last.offset >= min_offset:
                break
            self._remove(base)
            removed += 1
        return removed

    def _remove(self, base: int) -> None:
        os.close(self._fds.pop(base))
        (self.directory / segment_name(base)).unlink(missing_ok=True)
        self.dirty.discard(base)

    def take_dirty_fds(self) -> list[int]:
        """Duplicates of the descriptors written since the last call, and descriptors of the
        directories with new entries, for a checkpoint to fsync without racing the writer; the
        caller closes them."""
        fds = [os.dup(self._fds[b]) for b in self.dirty if b in self._fds]
        try:
            fds.extend(os.open(d, os.O_RDONLY) for d in self._new_in)
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        self.dirty.clear()
        self._new_in.clear()
        return fds

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
