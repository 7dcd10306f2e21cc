"""The durable recovery point: the message-log offset known fsynced, kept in `<data-dir>/recovery_point`.

Recovery cuts a bad record at the end of the active segment as a torn tail only past this point;
damage before it was fsynced (and maybe acknowledged), so it is corruption: the store refuses to open
and names `qmq log repair`. The flusher records the point after each fsync with one small pwrite and
no fsync of its own: a process kill keeps it (the page cache survives), a machine crash may leave an
older value, and both are safe, because the value written never exceeds what an fsync covered.

Format: offset (u64, big-endian) then CRC-32 of those 8 bytes; a file that does not check out counts
as no recovery point (the checkpoint's offset is the floor then).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from qmq.store import checksum

FILE_NAME = "recovery_point"
POINT = struct.Struct(">QI")


class RecoveryPoint:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / FILE_NAME
        self.fd = -1
        self.last = 0  # the last point recorded

    def load(self) -> int:
        """The recorded point, or 0 when there is none or it is damaged."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        if len(data) != POINT.size:
            return 0
        offset, crc = POINT.unpack(data)
        return offset if checksum.crc32(data[:8]) == crc else 0

    def open(self) -> int:
        """The file's descriptor, opened (created) on first use: the C flusher thread writes the
        point itself, in this format (qmq/store/_sync_thread.pyx)."""
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        return self.fd

    def record(self, offset: int) -> None:
        """Say everything before `offset` is fsynced (called by the flusher after each fsync)."""
        self.open()
        self.last = offset
        packed = struct.pack(">Q", offset)
        os.pwrite(self.fd, packed + struct.pack(">I", checksum.crc32(packed)), 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
