"""The delay server's clock: the system clock plus an offset that tests can shift.

Behaviour months ahead is tested without waiting: start the server with `--clock-file PATH`, and
write a number of seconds into that file; the server adds it to the system clock from then on
(within `CLOCK_POLL_S`), across restarts too. Without a clock file the offset is 0 and never changes.
Only the delay server's own decisions follow this clock (what is due, which bucket to load, the
limit on delays); brokers and clients keep the real time.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("qmq.delay")

CLOCK_POLL_S = 0.1  # how often the clock file is looked at


class Clock:
    def __init__(self, offset_file: str | os.PathLike | None = None) -> None:
        self.offset_file = Path(offset_file) if offset_file else None
        self.offset_ms = 0
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self.refresh()

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000 + self.offset_ms

    def now_s(self) -> float:
        return self.now_ms() / 1000

    def refresh(self) -> bool:
        """Re-read the clock file if it changed; True when the offset changed."""
        if self.offset_file is None:
            return False
        try:
            st = self.offset_file.stat()
        except FileNotFoundError:
            seen, offset_ms = None, 0
        else:
            seen = (st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return False
            text = self.offset_file.read_text().strip()
            try:
                offset_ms = round(float(text or 0) * 1000)
            except ValueError:
                log.error(
                    "clock file %s holds %r, not a number of seconds: keeping offset %g s",
                    self.offset_file,
                    text[:40],
                    self.offset_ms / 1000,
                )
                self._seen = seen
                return False
        self._seen = seen
        if offset_ms == self.offset_ms:
            return False
        log.warning("clock offset is now %g s (from %s)", offset_ms / 1000, self.offset_file)
        self.offset_ms = offset_ms
        return True
