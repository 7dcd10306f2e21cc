"""The retry schedule: messages a consumer failed on, waiting for the time their group asked to see
them again.

A nack becomes a `Schedule` entry in the journal and here; when it is due, the broker appends the
message to the group's `%RETRY%subject%group` subject and journals `Fired`. So the retry subject only
ever holds messages that are due, in the order they came due, and the group reads it with an ordinary
cursor: a message retried in an hour never holds up one retried in five seconds. What is kept per
entry is a few integers (the message stays in the message log), so thousands of pending retries
cost little memory. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import heapq
from collections import Counter

from qmq.broker.journal import Schedule


class RetrySchedule:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (due ms, schedule id); fired ids are skipped lazily
        self._pending: dict[int, Schedule] = {}
        self._per_subject: Counter[str] = Counter()
        self.next_id = 0

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, entry: Schedule) -> None:
        self._pending[entry.id] = entry
        self._per_subject[entry.retry_subject] += 1
        heapq.heappush(self._heap, (entry.due_ms, entry.id))
        self.next_id = max(self.next_id, entry.id + 1)

    def fired(self, ids: tuple[int, ...] | list[int]) -> None:
        for schedule_id in ids:
            entry = self._pending.pop(schedule_id, None)
            if entry is not None:
                self._per_subject[entry.retry_subject] -= 1
                if not self._per_subject[entry.retry_subject]:
                    del self._per_subject[entry.retry_subject]

    def next_due(self) -> int | None:
        """The earliest due time still pending (ms), or None."""
        while self._heap and self._heap[0][1] not in self._pending:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def take_due(self, now_ms: int, limit: int) -> list[Schedule]:
        """Up to `limit` entries due at `now_ms`, earliest first. They stay pending until `fired`; give
        back with `put_back` what could not be fired."""
        out: list[Schedule] = []
        while len(out) < limit and self.next_due() is not None and self._heap[0][0] <= now_ms:
            out.append(self._pending[heapq.heappop(self._heap)[1]])
        return out

    def put_back(self, entries: list[Schedule]) -> None:
        for entry in entries:
            if entry.id in self._pending:
                heapq.heappush(self._heap, (entry.due_ms, entry.id))

    def pending_for(self, retry_subject: str) -> int:
        return self._per_subject.get(retry_subject, 0)

    def entries(self) -> list[Schedule]:
        return sorted(self._pending.values(), key=lambda e: (e.due_ms, e.id))
