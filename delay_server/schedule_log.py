"""The schedule log: delayed messages filed by due time in buckets on disk (one per hour by default,
5 to 60 minutes configurable), each a full copy of the message, so the message log can be cleaned.

A bucket is two files named by the bucket's start (UTC, `YYYYMMDDHHMM`): `<name>.log` holds the
messages' message-log records, byte for byte, `<name>.idx` one 32-byte entry per record
(message-log offset, position in `.log`, due time, size, CRC), so loading a bucket into the wheel
reads 32 bytes per message, never the messages themselves. A message's position in its bucket is its
identity in the wheel and the dispatch log.

`checkpoint.json` names the message-log offset before which every delayed message is in its bucket
and the bucket files are fsynced. Buckets are appended in message-log order, so after a crash each
bucket the replay touches is cut back to its entries before that offset, and the replay appends the
rest again: no entry is ever in a bucket twice. Layout and recovery: docs/delay.md.
"""

from __future__ import annotations

import logging
import os
import resource
import struct
from collections import OrderedDict
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from qmq.store import checksum
from qmq.store import record as rec
from qmq.store.files import fsync_dir, fsync_path, pwrite_all, read_json, write_json

log = logging.getLogger("qmq.delay")

INDEX_HEAD = struct.Struct(">QQqI")  # message-log offset, position in the .log file, due ms, record size
INDEX = struct.Struct(">QQqII")  # the head, then the CRC-32 of its 28 bytes
INDEX_SIZE = INDEX.size  # 32
LOG_SUFFIX = ".log"
INDEX_SUFFIX = ".idx"
SETTINGS_FILE = "schedule.json"
CHECKPOINT_FILE = "checkpoint.json"
NAME_FORMAT = "%Y%m%d%H%M"
NAME_LEN = 12
DEFAULT_BUCKET_MINUTES = 60
BUCKET_MINUTES = (5, 6, 10, 12, 15, 20, 30, 60)  # divisors of an hour, so buckets start on the hour
MAX_OPEN_BUCKETS = 8192  # file pairs kept open (fewer when the open-files limit is lower)
RESERVED_FDS = 2048  # left for connections, the message log, loaded buckets and dispatch logs
LOAD_CHUNK_ENTRIES = 16_384  # index entries read at a time when loading a bucket
RECORD_READ_HINT = 4096  # bytes read for a record whose size is not known


class ScheduleError(Exception):
    """A schedule-log file that cannot be trusted, named with the place."""


class IndexEntry(NamedTuple):
    offset: int  # of the message in the message log: its identity
    position: int  # of its copy in the bucket's .log file
    due_ms: int
    size: int


def pack_index(offset: int, position: int, due_ms: int, size: int) -> bytes:
    head = INDEX_HEAD.pack(offset, position, due_ms, size)
    return head + checksum.crc32(head).to_bytes(4, "big")


def bucket_name(start_ms: int) -> str:
    return datetime.fromtimestamp(start_ms / 1000, tz=UTC).strftime(NAME_FORMAT)


def parse_bucket_name(name: str) -> int | None:
    """The start (ms) of the bucket called `name`, or None if it is not a bucket name."""
    if len(name) != NAME_LEN or not name.isdigit():
        return None
    try:
        return int(datetime.strptime(name, NAME_FORMAT).replace(tzinfo=UTC).timestamp() * 1000)
    except ValueError:
        return None


class Bucket:
    """The two files of one bucket. Appends come from one thread (the event loop); reads of entries
    below a count taken on that thread may come from any thread."""

    def __init__(self, directory: Path, start_ms: int, *, create: bool = False) -> None:
        self.start_ms = start_ms
        self.name = bucket_name(start_ms)
        self.log_path = directory / (self.name + LOG_SUFFIX)
        self.index_path = directory / (self.name + INDEX_SUFFIX)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        self.log_fd = os.open(self.log_path, flags, 0o644)
        try:
            self.index_fd = os.open(self.index_path, flags, 0o644)
        except OSError:
            os.close(self.log_fd)
            raise
        self.log_size = os.fstat(self.log_fd).st_size
        self.count = os.fstat(self.index_fd).st_size // INDEX_SIZE

    def append(self, items: list[tuple[int, int, bytes | memoryview]]) -> list[int]:
        """Append (message-log offset, due ms, record bytes) items; their positions in the .log file."""
        positions = []
        index = []
        position = self.log_size
        pack = pack_index
        for offset, due_ms, data in items:
            positions.append(position)
            size = len(data)
            index.append(pack(offset, position, due_ms, size))
            position += size
        pwrite_all(self.log_fd, b"".join(d for _, _, d in items), self.log_size)
        pwrite_all(self.index_fd, b"".join(index), self.count * INDEX_SIZE)
        self.log_size = position
        self.count += len(items)
        return positions

    def entries(self, first: int, count: int) -> list[IndexEntry]:
        """Index entries `first` .. `first + count - 1`, CRC-checked."""
        data = os.pread(self.index_fd, count * INDEX_SIZE, first * INDEX_SIZE)
        out = []
        crc32, head = checksum.crc32, INDEX_HEAD.size
        for i, (offset, position, due_ms, size, crc) in enumerate(
            INDEX.iter_unpack(data[: len(data) // INDEX_SIZE * INDEX_SIZE])
        ):
            at = i * INDEX_SIZE
            if crc32(data[at : at + head]) != crc:
                raise ScheduleError(f"{self.index_path}: bad entry {first + i} (CRC mismatch)")
            out.append(IndexEntry(offset, position, due_ms, size))
        return out

    def iter_due(self, count: int, chunk: int = LOAD_CHUNK_ENTRIES) -> Iterator[tuple[int, int, int]]:
        """(message-log offset, position, due ms) of the first `count` entries, CRC-checked: what
        loading a bucket needs, without an object per entry."""
        crc32, head = checksum.crc32, INDEX_HEAD.size
        for first in range(0, count, chunk):
            data = os.pread(self.index_fd, min(chunk, count - first) * INDEX_SIZE, first * INDEX_SIZE)
            at = 0
            for offset, position, due_ms, _size, crc in INDEX.iter_unpack(data):
                if crc32(data[at : at + head]) != crc:
                    raise ScheduleError(f"{self.index_path}: bad entry {first + at // INDEX_SIZE} (CRC mismatch)")
                at += INDEX_SIZE
                yield offset, position, due_ms

    def read_record(self, position: int, size: int = 0) -> rec.Record:
        """The record copy at `position` of the .log file, CRC-checked; its offset is the position."""
        data = os.pread(self.log_fd, size or RECORD_READ_HINT, position)
        try:
            try:
                return rec.decode(data, 0, position)
            except rec.TruncatedRecord:
                if len(data) < rec.HEADER_SIZE:
                    raise
                return rec.decode(os.pread(self.log_fd, rec.PREFIX.unpack_from(data, 0)[0], position), 0, position)
        except rec.RecordError as exc:
            raise ScheduleError(f"{self.log_path}: {exc}") from None

    def cut_from(self, offset: int) -> int:
        """Drop the entries (and their records) of message-log offsets at or after `offset`, and any
        damaged tail, so a replay from `offset` can append them again; how many entries went."""
        count = self.count
        while count > 0:
            entry = self._entry_or_none(count - 1)
            if entry is not None and entry.offset < offset:
                break
            count -= 1
        end = 0
        if count:
            last = self._entry_or_none(count - 1)
            assert last is not None
            end = last.position + last.size
            if end > self.log_size:
                raise ScheduleError(
                    f"{self.log_path}: index entry {count - 1} points past the end of the file "
                    f"({end} > {self.log_size})"
                )
        dropped = self.count - count
        if dropped or end != self.log_size or os.fstat(self.index_fd).st_size != count * INDEX_SIZE:
            os.ftruncate(self.index_fd, count * INDEX_SIZE)
            os.ftruncate(self.log_fd, end)
            os.fsync(self.index_fd)
            os.fsync(self.log_fd)
            self.count, self.log_size = count, end
        return dropped

    def _entry_or_none(self, number: int) -> IndexEntry | None:
        try:
            return self.entries(number, 1)[0]
        except (ScheduleError, IndexError):
            return None

    def close(self) -> None:
        for fd in (self.log_fd, self.index_fd):
            if fd >= 0:
                os.close(fd)
        self.log_fd = self.index_fd = -1


class ScheduleLog:
    """Every bucket of a delay server's data directory, with a bounded number of them open."""

    def __init__(self, directory: Path, bucket_minutes: int = DEFAULT_BUCKET_MINUTES) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.bucket_minutes = _fixed_bucket_minutes(directory, bucket_minutes)
        self.bucket_ms = self.bucket_minutes * 60_000
        self.starts: set[int] = set()
        for path in directory.glob("*" + LOG_SUFFIX):
            start = parse_bucket_name(path.name[: -len(LOG_SUFFIX)])
            if start is not None:
                self.starts.add(start)
        self.checkpoint_offset = _load_checkpoint(directory)
        self._open: OrderedDict[int, Bucket] = OrderedDict()
        self.max_open = open_bucket_limit()
        self._dirty: set[int] = set()  # buckets written since the last checkpoint
        self._new_files = False

    def start_of(self, due_ms: int) -> int:
        return due_ms - due_ms % self.bucket_ms

    def bucket(self, start_ms: int, *, create: bool = False) -> Bucket | None:
        """The open bucket starting at `start_ms`; None if it does not exist and `create` is false."""
        bucket = self._open.get(start_ms)
        if bucket is not None:
            self._open.move_to_end(start_ms)
            return bucket
        if start_ms not in self.starts and not create:
            return None
        bucket = Bucket(self.directory, start_ms, create=True)
        if start_ms not in self.starts:
            self.starts.add(start_ms)
            self._new_files = True  # the directory is fsynced by the next checkpoint
        self._open[start_ms] = bucket
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)[1].close()  # still dirty: the checkpoint fsyncs it by name
        return bucket

    def append(self, start_ms: int, items: list[tuple[int, int, bytes | memoryview]]) -> tuple[Bucket, list[int]]:
        bucket = self.bucket(start_ms, create=True)
        assert bucket is not None
        positions = bucket.append(items)
        self._dirty.add(start_ms)
        return bucket, positions

    def count(self, start_ms: int) -> int:
        """Entries in a bucket (opens it)."""
        bucket = self.bucket(start_ms)
        return bucket.count if bucket is not None else 0

    def take_dirty(self) -> list[Path]:
        """The files written since the last call (and the directory, after a bucket was created),
        for a checkpoint to fsync."""
        paths = []
        for start in self._dirty:
            name = bucket_name(start)
            paths += [self.directory / (name + LOG_SUFFIX), self.directory / (name + INDEX_SUFFIX)]
        self._dirty.clear()
        if self._new_files:
            paths.append(self.directory)
            self._new_files = False
        return paths

    def save_checkpoint(self, offset: int, dirty: list[Path]) -> None:
        """Fsync the `dirty` files and record that the message log before `offset` is in the
        buckets. Blocking: run it off the event loop."""
        for path in dirty:
            fsync_path(path)
        write_json(self.directory / CHECKPOINT_FILE, {"version": 1, "offset": offset})
        self.checkpoint_offset = offset

    def remove(self, start_ms: int) -> None:
        """Delete a bucket's files (retention of delivered buckets)."""
        bucket = self._open.pop(start_ms, None)
        if bucket is not None:
            if start_ms in self._dirty:
                self._dirty.discard(start_ms)
            bucket.close()
        self.starts.discard(start_ms)
        name = bucket_name(start_ms)
        for suffix in (LOG_SUFFIX, INDEX_SUFFIX):
            (self.directory / (name + suffix)).unlink(missing_ok=True)
        fsync_dir(self.directory)

    def close(self) -> None:
        for bucket in self._open.values():
            bucket.close()
        self._open.clear()


def open_bucket_limit() -> int:
    """Buckets kept open at once: appends to far-apart times open and close others, which is slow."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(16, min(MAX_OPEN_BUCKETS, (soft - RESERVED_FDS) // 3))


def _load_checkpoint(directory: Path) -> int:
    path = directory / CHECKPOINT_FILE
    try:
        saved = read_json(path)
        return 0 if saved is None else int(saved["offset"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ScheduleError(f"{path}: unreadable schedule checkpoint ({exc})") from None


def _fixed_bucket_minutes(directory: Path, wanted: int) -> int:
    """The bucket size is fixed when the schedule log is created (bucket files are named by start)."""
    if wanted not in BUCKET_MINUTES:
        raise ValueError(f"bucket minutes must be one of {', '.join(map(str, BUCKET_MINUTES))}, not {wanted}")
    path = directory / SETTINGS_FILE
    settings = read_json(path)
    if settings is not None:
        saved = int(settings["bucket_minutes"])
        if saved != wanted:
            log.warning("this schedule log has %d-minute buckets; keeping them (asked for %d)", saved, wanted)
        return saved
    write_json(path, {"format": 1, "bucket_minutes": wanted})
    return wanted
