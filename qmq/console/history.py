"""Backlog and rates over time: the console samples every broker's figures (BROKER_STATS) on its own
thread and keeps the last `history_s` seconds, so a consumer group's page can draw its backlog going
down while a worker consumes. Rates are computed between two samples (stored and acknowledged
messages per second), sharper than the brokers' one-minute rates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qmq.admin.views import stats_view

log = logging.getLogger("qmq.console")

DEFAULT_SAMPLE_INTERVAL_S = 5.0
DEFAULT_HISTORY_S = 3600.0


@dataclass(frozen=True)
class GroupSample:
    at: float  # seconds since the epoch
    backlog: int
    in_flight: int
    retrying: int
    dead: int
    out_rate: float | None  # acknowledged per second since the sample before


@dataclass(frozen=True)
class SubjectSample:
    at: float
    stored: int
    in_rate: float | None  # stored per second since the sample before


class History:
    """The samples, by (subject, group) and by subject. Thread-safe: the sampler adds, pages read."""

    def __init__(self, history_s: float = DEFAULT_HISTORY_S, interval_s: float = DEFAULT_SAMPLE_INTERVAL_S) -> None:
        self.history_s, self.interval_s = history_s, interval_s
        self.keep = max(2, int(history_s / interval_s) + 1)
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, str], deque[GroupSample]] = {}
        self._subjects: dict[str, deque[SubjectSample]] = {}
        self._last: dict[Any, tuple[float, int]] = {}  # counter -> (time, value) of the last sample
        self.last_error: str | None = None
        self.last_at: float | None = None

    def add(self, at: float, view: dict[str, Any]) -> None:
        """One sample: a `stats_view` taken at `at`."""
        with self._lock:
            for g in view["groups"]:
                key = (g["subject"], g["group"])
                rate = self._rate(("acked", key), at, g["acked"])
                series = self._groups.setdefault(key, deque(maxlen=self.keep))
                series.append(GroupSample(at, g["backlog"], g["in_flight"], g["retrying"], g["dead"], rate))
            for s in view["subjects"]:
                rate = self._rate(("stored", s["subject"]), at, s["stored"])
                series = self._subjects.setdefault(s["subject"], deque(maxlen=self.keep))
                series.append(SubjectSample(at, s["stored"], rate))
            self.last_at = at

    def _rate(self, counter: Any, at: float, value: int) -> float | None:
        before = self._last.get(counter)
        self._last[counter] = (at, value)
        if before is None or at <= before[0] or value < before[1]:  # first sample, or a broker restarted
            return None
        return (value - before[1]) / (at - before[0])

    def group(self, subject: str, group: str) -> list[GroupSample]:
        with self._lock:
            return list(self._groups.get((subject, group), ()))

    def subject(self, subject: str) -> list[SubjectSample]:
        with self._lock:
            return list(self._subjects.get(subject, ()))


class Sampler:
    """The thread that feeds a `History` every `interval_s` from `take` (a stats call)."""

    def __init__(self, history: History, take: Callable[[], list[Any]], interval_s: float) -> None:
        self.history = history
        self.take = take
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qmq-console-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 30)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.history.add(time.time(), stats_view(self.take()))
                self.history.last_error = None
            except Exception as exc:  # the meta server or brokers are away: say so on the pages, go on
                if str(exc) != self.history.last_error:
                    log.warning("sampling the brokers' figures failed: %s", exc)
                self.history.last_error = str(exc)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
