"""Cancelled message ids: kept on disk and in memory until no message they name can still be due.

A cancel names a message id only (an order cancelled before its reminder does not know when the
reminder was due), and must hold longer than the message log is kept, so cancels have their own
files: `cancels/<YYYYMM>.log`, records in the message-log layout, filed by the month in which the
cancel may be forgotten (its time of acceptance plus the longest delay allowed). A file is deleted
once its month is over. Every cancel is in memory (an id -> keep-until map): the wheel checks each
message against it when it comes due. Appending a cancel twice (a replay after a crash) is harmless.
"""

from __future__ import annotations

import logging
import os
from datetime import UTC, datetime
from pathlib import Path

from delay_server import records
from qmq.store import record as rec

log = logging.getLogger("qmq.delay")

SUFFIX = ".log"
MONTH_FORMAT = "%Y%m"


def month_of(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime(MONTH_FORMAT)


def month_end_ms(month: str) -> int:
    start = datetime.strptime(month, MONTH_FORMAT).replace(tzinfo=UTC)
    nxt = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return int(nxt.timestamp() * 1000)


def iter_cancels(path: Path) -> list[rec.Record]:
    """The cancel records of one file; a damaged tail (a torn write) ends it with a warning."""
    found, error = records.read_file(path)
    if error is not None:
        log.warning("%s: %s; the cancels after it are ignored", path, error)
    return found


class Cancels:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.keep_until: dict[str, int] = {}  # message id -> ms
        self._fds: dict[str, int] = {}
        self._dirty: set[str] = set()
        self._new_file = False
        for path in sorted(directory.glob("*" + SUFFIX)):
            for record in iter_cancels(path):
                self._remember(record.message_id, records.due_of(record.payload))

    def __contains__(self, message_id: str) -> bool:
        return message_id in self.keep_until

    def __len__(self) -> int:
        return len(self.keep_until)

    def add(self, items: list[tuple[int, str, int]]) -> None:
        """Record (message-log offset, message id, keep until ms) cancels (page cache; fsynced by the
        schedule checkpoint)."""
        by_month: dict[str, list[bytes]] = {}
        for offset, message_id, keep_until in items:
            self._remember(message_id, keep_until)
            data = rec.encode(
                rec.Attr.MESSAGE,
                records.CANCEL,
                0,
                offset,
                b"",
                message_id.encode(),
                b"",
                b"",
                records.DUE.pack(keep_until),
            )
            by_month.setdefault(month_of(keep_until), []).append(data)
        for month, chunks in by_month.items():
            os.write(self._fd(month), b"".join(chunks))
            self._dirty.add(month)

    def _remember(self, message_id: str, keep_until: int) -> None:
        if keep_until > self.keep_until.get(message_id, 0):
            self.keep_until[message_id] = keep_until

    def _fd(self, month: str) -> int:
        fd = self._fds.get(month)
        if fd is None:
            fd = os.open(self.directory / (month + SUFFIX), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._fds[month] = fd
            self._new_file = True
        return fd

    def take_dirty(self) -> list[Path]:
        """Files written since the last call, for the checkpoint to fsync."""
        paths = [self.directory / (m + SUFFIX) for m in self._dirty]
        self._dirty.clear()
        if self._new_file:
            paths.append(self.directory)
            self._new_file = False
        return paths

    def expire(self, now_ms: int) -> int:
        """Forget cancels kept until before `now_ms`; delete files of months that are over."""
        expired = [i for i, until in self.keep_until.items() if until < now_ms]
        for message_id in expired:
            del self.keep_until[message_id]
        for path in self.directory.glob("*" + SUFFIX):
            month = path.name[: -len(SUFFIX)]
            if len(month) == 6 and month.isdigit() and month_end_ms(month) <= now_ms:
                fd = self._fds.pop(month, None)
                if fd is not None:
                    os.close(fd)
                self._dirty.discard(month)
                path.unlink()
                log.info("retention: deleted cancels file %s", path.name)
        return len(expired)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
