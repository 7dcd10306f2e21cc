"""The background scrub: after open, CRC-check the sealed segments that opening did not check, at a
paced rate, so damage in an old segment is found (and reported with file and offset) before a reader
meets it, without starving the server's event loop.

Opening checks only the newest segments and what follows the checkpoint (store.py); this thread
reads the rest once, oldest first, at most `SCRUB_BYTES_PER_S`, and hands each damaged region to the
store's `report` callback (a log line, the `damaged` list that BROKER_STATS and the metrics show).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable

from qmq.store import record as rec
from qmq.store.message_log import MessageLog

log = logging.getLogger("qmq.store")

SCRUB_BYTES_PER_S = 8 * 1024 * 1024  # pacing: about half of what one core checks (bench/store_scrub.py)
SCRUB_STEP_BYTES = 1024 * 1024  # checked between pauses

Report = Callable[[str, int, int, str], None]  # (segment file, offset, end of the damage, reason)


class Scrub:
    def __init__(
        self, message_log: MessageLog, end: int, report: Report, bytes_per_s: float = SCRUB_BYTES_PER_S
    ) -> None:
        """Check the segments that end at or before `end` (the part opening did not check)."""
        self.message_log = message_log
        self.end = end
        self.report = report
        self.bytes_per_s = bytes_per_s
        self.checked_bytes = 0
        self.seconds = 0.0  # time spent, pauses included
        self.done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qmq-store-scrub", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for segment in list(self.message_log.segments):
                if segment.end > self.end or self._stop.is_set():
                    break
                if segment.size and segment.fd >= 0:
                    self._check(segment, started)
        except Exception:  # a segment removed by retention meanwhile, a closed store
            log.debug("scrub stopped early", exc_info=True)
        finally:
            self.seconds = time.monotonic() - started
            self.done.set()
            log.info("scrub of %d bytes of sealed segments done in %.1f s", self.checked_bytes, self.seconds)

    def _check(self, segment, started: float) -> None:
        with mmap.mmap(segment.fd, segment.size, access=mmap.ACCESS_READ) as data:
            pos = 0
            next_pause = SCRUB_STEP_BYTES
            while pos < len(data) and not self._stop.is_set():
                try:
                    record = rec.decode(data, pos, segment.base)
                    pos += record.size
                except rec.RecordError as exc:
                    resume = rec.find_next_valid(data, pos, segment.base)
                    end = segment.base + (resume if resume is not None else len(data))
                    self.report(str(segment.path), exc.offset, end, exc.reason)
                    self.checked_bytes += (resume if resume is not None else len(data)) - pos
                    if resume is None:
                        return
                    pos = resume
                    continue
                self.checked_bytes += record.size
                if pos >= next_pause:
                    next_pause = pos + SCRUB_STEP_BYTES
                    ahead = self.checked_bytes / self.bytes_per_s - (time.monotonic() - started)
                    time.sleep(max(ahead, 0.001))  # and always let other threads run
