"""The dispatch log: which messages of a bucket a broker has acknowledged, so a restart does not
deliver them again.

One file per bucket, `dispatch/<bucket name>.dispatch`, of 12-byte entries: the message's position in
the bucket's `.log` file (its identity: a replay after a crash files the same records in the same
order, so positions do not change) and a CRC-32 of those 8 bytes, appended after the broker's
acknowledgement and fsynced with the schedule checkpoint (a crash may forget the last
moment's entries: those messages are delivered again, at least once). The same positions are noted
in the message log (a dispatch note, records.py): a replica, or a replay, files them here too. A damaged entry (a torn
write) is ignored. `<bucket name>.done` marks a bucket whose every message was delivered or
cancelled; it is not loaded again, and is deleted with the bucket after the retention.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from delay_server.schedule_log import bucket_name
from qmq.store import checksum
from qmq.store.files import fsync_dir

ENTRY = struct.Struct(">QI")  # position in the bucket's .log file, CRC-32 of its 8 bytes
ENTRY_SIZE = ENTRY.size  # 12
SUFFIX = ".dispatch"
DONE_SUFFIX = ".done"
POSITION = struct.Struct(">Q")


def pack_entry(position: int) -> bytes:
    raw = POSITION.pack(position)
    return raw + struct.pack(">I", checksum.crc32(raw))


def read_entries(path: Path) -> tuple[list[int], int]:
    """The positions recorded in a dispatch file, and how many entries were damaged."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], 0
    offsets, bad = [], 0
    for i in range(len(data) // ENTRY_SIZE):
        at = i * ENTRY_SIZE
        offset, crc = ENTRY.unpack_from(data, at)
        if checksum.crc32(data[at : at + 8]) == crc:
            offsets.append(offset)
        else:
            bad += 1
    return offsets, bad


class DispatchLog:
    """The dispatch file of one bucket, open while the bucket is loaded."""

    def __init__(self, directory: Path, start_ms: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        name = bucket_name(start_ms)
        self.path = directory / (name + SUFFIX)
        self.done_path = directory / (name + DONE_SUFFIX)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self.dirty = False

    def delivered(self) -> set[int]:
        return set(read_entries(self.path)[0])

    def append(self, positions: list[int]) -> None:
        os.write(self.fd, b"".join(map(pack_entry, positions)))
        self.dirty = True

    def take_dirty(self) -> list[Path]:
        dirty, self.dirty = self.dirty, False
        return [self.path] if dirty else []

    def mark_done(self) -> None:
        """Every message of the bucket is delivered or cancelled: make it so on disk."""
        os.fsync(self.fd)
        self.done_path.touch()
        fsync_dir(self.directory)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def append_to(directory: Path, start_ms: int, positions: list[int]) -> Path:
    """Append positions to a bucket's dispatch file that is not open (filing a dispatch note from
    the message log); the file, for the checkpoint to fsync."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (bucket_name(start_ms) + SUFFIX)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"".join(map(pack_entry, positions)))
    finally:
        os.close(fd)
    return path


def mark_done_file(directory: Path, start_ms: int) -> None:
    """Mark a bucket that is not loaded done (filing a bucket-done note); the directory is fsynced
    by the next checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / (bucket_name(start_ms) + DONE_SUFFIX)).touch()


def is_done(directory: Path, start_ms: int) -> bool:
    return (directory / (bucket_name(start_ms) + DONE_SUFFIX)).exists()


def remove(directory: Path, start_ms: int) -> None:
    name = bucket_name(start_ms)
    for suffix in (SUFFIX, DONE_SUFFIX):
        (directory / (name + suffix)).unlink(missing_ok=True)
