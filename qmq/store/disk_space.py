"""Disk space and write failures: what turns a store read-only, and how it learns it may write again.

Two kinds of failure, told apart by their errno:
- out of space (ENOSPC, EDQUOT) on a write: nothing acknowledged is at risk; the store undoes the
  partial append, refuses writes and probes every `PROBE_INTERVAL_S` whether `PROBE_BYTES` can be
  reserved again; once they can, it takes writes without a restart;
- anything else (EIO, ...) and every fsync failure: the page cache may have dropped data the disk
  never got (PostgreSQL's "fsyncgate"), so retrying would acknowledge what may be lost; the store stays
  read-only until it is reopened, which checks the log from the durable recovery point.

Space is reserved before it is mapped: a file written through mmap (the key index) has its pages
allocated and written with zeros first (`reserve_written`), so a full disk is an ENOSPC on that
write, never a SIGBUS, and no write through the map waits for the file system's journal.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

OUT_OF_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
PROBE_INTERVAL_S = 1.0  # while out of space, how often the store tries to reserve space again
PROBE_BYTES = 4 * 1024 * 1024  # what must be reservable before writes resume
PROBE_FILE = "space-probe.tmp"
ZERO_CHUNK_BYTES = 1 << 20  # zeros written at once by reserve_written


def is_out_of_space(exc: BaseException) -> bool:
    """True for a failure that a freed disk cures (the store may resume writing after a probe)."""
    return isinstance(exc, OSError) and exc.errno in OUT_OF_SPACE


def reserve(fd: int, offset: int, length: int) -> None:
    """Allocate `length` bytes of the file at `offset` (raises OSError ENOSPC when the disk is full).
    File systems without fallocate support fall back to writing zeros where nothing is allocated."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        _reserve_by_writing(fd, offset, length)


def reserve_written(fd: int, offset: int, length: int) -> None:
    """Allocate `length` bytes at `offset` by writing zeros into the holes of that range (what is
    written already, or cached, stays as it is), for a file written through mmap at random places:
    a page of an extent that is allocated but never written (what `posix_fallocate` leaves, which
    SEEK_DATA counts as a hole) makes the file system convert it on the first write, and on ext4 that
    waits for the journal, that is for any fsync in progress. Raises OSError ENOSPC when the disk is
    full."""
    end = offset + length
    position = offset
    while position < end:
        try:
            data = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no data from here to the end of the file
                raise
            data = end
        hole_end = min(data, end)
        while position < hole_end:
            size = min(ZERO_CHUNK_BYTES, hole_end - position)
            os.pwrite(fd, bytes(size), position)
            position += size
        if position >= end:
            return
        position = os.lseek(fd, position, os.SEEK_HOLE)


def _reserve_by_writing(fd: int, offset: int, length: int) -> None:
    """Writing zeros allocates blocks on any file system; only holes are filled, so data stays."""
    chunk = 1 << 20
    end = offset + length
    while offset < end:
        size = min(chunk, end - offset)
        current = os.pread(fd, size, offset)
        if len(current) < size or current.count(0) == size:
            os.pwrite(fd, current + bytes(size - len(current)), offset)
        offset += size


def space_available(directory: Path, need: int = PROBE_BYTES) -> bool:
    """Whether `need` bytes can be reserved in `directory` now (by reserving them and letting go)."""
    path = directory / PROBE_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return False
    try:
        reserve(fd, 0, need)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
