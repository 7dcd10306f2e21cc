"""The key index: finds records by message id or by (subject, key) in a bounded number of reads.

An index file is a hash table on disk in the manner of RocketMQ's IndexFile: a fixed array of slots,
each holding the newest entry of its bucket, and entries chained to the previous one in the bucket.
A look-up reads one slot and walks one chain per index file; the caller confirms each candidate
against the record itself, so hash collisions cost a read, never a wrong answer. Files roll when full
and are named by the first message-log offset they index. Derived from the message log.

The file is sparse and written through mmap, so every page is allocated and zeroed
(`disk_space.reserve_written`) before it is written: the header and slots when the file is opened,
entries `RESERVE_AHEAD_BYTES` at a time. A full disk is then an ENOSPC from `add`, never a SIGBUS;
and a random write into the slots never waits for an fsync (on ext4 a page fallocated but never
written would: with random message ids that halved a broker's throughput, docs/benchmarks.md).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from qmq.store import speedups
from qmq.store.disk_space import reserve_written
from qmq.store.files import TMP_SUFFIX, replace_durably, tmp_path
from qmq.store.segment import list_segments, segment_name

FILE_MAGIC = 0x514D4958  # "QMIX"
HEADER = struct.Struct(">IIIIQ")  # magic, slot_count, capacity, count, last_offset
HEADER_SIZE = 64
SLOT = struct.Struct(">I")  # entry number + 1; 0 = empty
ENTRY = struct.Struct(">QQI")  # hash, message-log offset, previous entry number + 1
DEFAULT_SLOTS = 1 << 22  # 16 MiB of slots
DEFAULT_CAPACITY = 1 << 24  # 320 MiB of entries, allocated sparsely
MAX_CHAIN = 1 << 16  # a chain longer than this is corruption, not load
RESERVE_AHEAD_BYTES = 1 << 20  # entry space allocated at a time, before the mmap writes into it


class IndexFile:
    def __init__(self, path: Path, base: int, slots: int, capacity: int, *, create: bool) -> None:
        self.path = path
        self.base = base
        if create:
            _create(path, slots, capacity)
        self.fd = os.open(path, os.O_RDWR)
        self.mm = mmap.mmap(self.fd, 0) if os.fstat(self.fd).st_size >= HEADER_SIZE else None
        if self.mm is None or HEADER.unpack_from(self.mm, 0)[0] != FILE_MAGIC:
            self.close()
            raise ValueError(
                f"{path}: not a key-index file; `qmq log repair --data-dir DIR` (server stopped) rebuilds "
                f"the derived files from the message log"
            )
        _magic, self.slots, self.capacity, self.count, self.last_offset = HEADER.unpack_from(self.mm, 0)
        self.entries_at = HEADER_SIZE + self.slots * SLOT.size
        self.size = os.fstat(self.fd).st_size
        try:
            reserve_written(self.fd, 0, min(self.entries_at, self.size))  # slots are written anywhere: all, now
        except OSError:
            self.close()
            raise
        self.reserved_to = self.entries_at + self.count * ENTRY.size  # allocated up to here (at least)

    def _reserve_entries(self, count: int) -> None:
        """Allocate the file up to entry `count` (exclusive) and some way beyond it."""
        needed = self.entries_at + count * ENTRY.size
        if needed <= self.reserved_to:
            return
        end = min(self.size, max(needed, self.reserved_to + RESERVE_AHEAD_BYTES))
        reserve_written(self.fd, self.reserved_to, end - self.reserved_to)
        self.reserved_to = end

    @property
    def full(self) -> bool:
        return self.count >= self.capacity

    def add(self, pairs, start: int) -> int:
        """Insert `pairs[start:]` (hash, offset) until full; returns how many went in."""
        mm, slots, entries_at = self.mm, self.slots, self.entries_at
        n = self.count
        room = self.capacity - n
        taken = pairs[start : start + room]
        self._reserve_entries(n + len(taken))
        if speedups.compiled is not None:
            n = speedups.compiled.index_add(mm, slots, entries_at, n, taken)
        else:
            n = self._add_py(taken, n)
        if taken:
            self.count = n
            self.last_offset = max(self.last_offset, taken[-1][1])
            HEADER.pack_into(mm, 0, FILE_MAGIC, slots, self.capacity, n, self.last_offset)
        return len(taken)

    def _add_py(self, taken: list[tuple[int, int]], n: int) -> int:
        """The loop of `add` in Python (the reference for the compiled one): chain each pair in after
        entry `n`; the new count."""
        mm, slots, entries_at = self.mm, self.slots, self.entries_at
        for h, offset in taken:
            slot_at = HEADER_SIZE + ((h >> 32) % slots) * SLOT.size
            prev = SLOT.unpack_from(mm, slot_at)[0]
            ENTRY.pack_into(mm, entries_at + n * ENTRY.size, h, offset, prev)
            n += 1
            SLOT.pack_into(mm, slot_at, n)
        return n

    def find(self, h: int) -> list[int]:
        """Offsets of entries with hash `h`, newest first."""
        out = []
        mm = self.mm
        number = SLOT.unpack_from(mm, HEADER_SIZE + ((h >> 32) % self.slots) * SLOT.size)[0]
        steps = 0
        while number and number <= self.count and steps < MAX_CHAIN:
            eh, offset, prev = ENTRY.unpack_from(mm, self.entries_at + (number - 1) * ENTRY.size)
            if eh == h:
                out.append(offset)
            if prev >= number:
                break  # chains only point backwards; anything else is damage
            number = prev
            steps += 1
        return out

    def undo_to(self, count: int) -> None:
        """Forget entries at or after `count`, newest first, restoring each bucket's previous head and
        zeroing the entry. Entries a crash left written past the header's count (a batch is counted
        only at its end) are found and undone too, or their buckets would point past the count."""
        mm = self.mm
        written = self.count
        while written < self.capacity and any(ENTRY.unpack_from(mm, self.entries_at + written * ENTRY.size)):
            written += 1
        blank = bytes(ENTRY.size)
        for number in range(written, count, -1):
            at = self.entries_at + (number - 1) * ENTRY.size
            h, _offset, prev = ENTRY.unpack_from(mm, at)
            slot_at = HEADER_SIZE + ((h >> 32) % self.slots) * SLOT.size
            if SLOT.unpack_from(mm, slot_at)[0] == number:
                SLOT.pack_into(mm, slot_at, prev)
            mm[at : at + ENTRY.size] = blank
        self.count = min(written, count)
        HEADER.pack_into(mm, 0, FILE_MAGIC, self.slots, self.capacity, self.count, self.last_offset)

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
        os.close(self.fd)


def _create(path: Path, slots: int, capacity: int) -> None:
    """Make a sized, initialised index file under a temporary name, then rename it into place, so a
    crash never leaves a half-made index file behind (only a `.tmp` that the next open removes).
    Its slots are written and synced here: left for later, their 16 MiB of new blocks would ride on
    the message log's next fsyncs (ext4's ordered mode writes them with the journal commit)."""
    tmp = tmp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, HEADER_SIZE + slots * SLOT.size + capacity * ENTRY.size)
        reserve_written(fd, 0, HEADER_SIZE + slots * SLOT.size)  # synced by replace_durably below
        os.pwrite(fd, HEADER.pack(FILE_MAGIC, slots, capacity, 0, 0), 0)
    finally:
        os.close(fd)
    replace_durably(tmp, path)


class KeyIndex:
    """All index files of a store, oldest first. One writer (the store), many readers."""

    def __init__(self, directory: Path, slots: int = DEFAULT_SLOTS, capacity: int = DEFAULT_CAPACITY) -> None:
        self.directory = directory
        self.slots = slots
        self.capacity = capacity
        directory.mkdir(parents=True, exist_ok=True)
        for leftover in directory.glob("*" + TMP_SUFFIX):
            leftover.unlink()
        self.files = [IndexFile(p, base, slots, capacity, create=False) for base, p in list_segments(directory)]
        self._dirty: set[IndexFile] = set()

    def prepare(self, next_offset: int) -> None:
        """Make the first index file now, named by the offset the message log writes next, if there
        is none: at open rather than in the first send, which would wait for its slots."""
        if not self.files:
            path = self.directory / segment_name(next_offset)
            self.files.append(IndexFile(path, next_offset, self.slots, self.capacity, create=True))

    def add(self, pairs: list[tuple[int, int]]) -> None:
        done = 0
        while done < len(pairs):
            if not self.files or self.files[-1].full:
                base = pairs[done][1]
                self.files.append(
                    IndexFile(self.directory / segment_name(base), base, self.slots, self.capacity, create=True)
                )
            done += self.files[-1].add(pairs, done)
            self._dirty.add(self.files[-1])

    def find(self, h: int) -> list[int]:
        out = []
        for index_file in reversed(self.files):
            out.extend(index_file.find(h))
        return out

    def state(self) -> dict:
        if not self.files:
            return {"file": None, "count": 0}
        return {"file": self.files[-1].base, "count": self.files[-1].count}

    def restore(self, state: dict | None) -> None:
        """Return to a checkpoint's state, so replaying from the checkpoint adds nothing twice."""
        base = state["file"] if state else None
        count = state["count"] if state else 0
        while self.files and (base is None or self.files[-1].base > base):
            self._drop(self.files.pop())
        if self.files and self.files[-1].base == base:
            self.files[-1].undo_to(count)

    def remove_files_before(self, min_offset: int) -> int:
        removed = 0
        while len(self.files) > 1 and self.files[0].last_offset < min_offset:
            self._drop(self.files.pop(0))
            removed += 1
        return removed

    def _drop(self, index_file: IndexFile) -> None:
        self._dirty.discard(index_file)
        index_file.close()
        index_file.path.unlink(missing_ok=True)

    def take_dirty_fds(self) -> list[int]:
        fds = [os.dup(f.fd) for f in self._dirty if f in self.files]
        self._dirty.clear()
        return fds

    def close(self) -> None:
        for index_file in self.files:
            index_file.close()
        self.files.clear()
