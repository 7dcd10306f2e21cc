"""A segment: one file of a segmented log, named by the log offset of its first byte in 20 digits.

Segments only grow at the end; reads use positional I/O so readers never disturb the writer.
"""

from __future__ import annotations

import os
from pathlib import Path

from qmq.store.files import fsync_dir, pwrite_all

NAME_DIGITS = 20


def segment_name(base: int, suffix: str = "") -> str:
    return f"{base:0{NAME_DIGITS}d}{suffix}"


def list_segments(directory: Path, suffix: str = "") -> list[tuple[int, Path]]:
    """(base, path) of every segment file in `directory`, in order."""
    found = []
    if directory.is_dir():
        for path in directory.iterdir():
            stem = path.name[: -len(suffix)] if suffix and path.name.endswith(suffix) else path.name
            if len(stem) == NAME_DIGITS and stem.isdigit() and (not suffix or path.name.endswith(suffix)):
                found.append((int(stem), path))
    return sorted(found)


class Segment:
    """An open segment file. `size` is the number of bytes written, flushed or not."""

    def __init__(self, directory: Path, base: int, *, create: bool = False) -> None:
        self.base = base
        self.path = directory / segment_name(base)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(self.path, flags, 0o644)
        self.size = os.fstat(self.fd).st_size
        if create:
            fsync_dir(directory)

    @property
    def end(self) -> int:
        return self.base + self.size

    def append(self, data: bytes) -> None:
        pwrite_all(self.fd, data, self.size)
        self.size += len(data)

    def read(self, position: int, size: int) -> bytes:
        """`size` bytes from `position` within the segment (fewer at its end)."""
        return os.pread(self.fd, size, position)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def truncate(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        os.fsync(self.fd)
        self.size = size

    def mtime(self) -> float:
        return os.fstat(self.fd).st_mtime

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
