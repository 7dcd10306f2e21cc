"""Everything a broker knows about consumption: every consumer group of every stored subject, the
retry schedule and how far each dead-letter subject was re-driven.

It changes only through journal entries (`apply`), live or replayed, so the state after a restart is
the last snapshot plus the journal after it. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from typing import Any

from qmq.broker.consumer_group import ConsumerGroup, Reset
from qmq.broker.journal import Create, Delete, Entry, Fired, GroupAction, Redriven, Schedule
from qmq.broker.queue_lease import KeyStopped, Leased, QueueLeases
from qmq.broker.retry import RetrySchedule
from qmq.broker.system_subjects import dead_subject, retry_subject

SNAPSHOT_VERSION = 1


class BrokerState:
    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], ConsumerGroup] = {}  # (stored subject, group key) -> group
        self.retries = RetrySchedule()
        self.redriven: dict[str, int] = {}  # dead subject -> first sequence not yet re-driven
        self.dead_done: dict[str, set[int]] = {}  # dead subject -> sequences re-driven or purged one by one
        self.journal_seq = 0  # the next journal sequence to apply (what a snapshot covers)
        self.leases = QueueLeases()  # who holds each queue of an ordered subject

    def group(self, stored_subject: str, key: str) -> ConsumerGroup | None:
        return self.groups.get((stored_subject, key))

    def apply(self, entry: Entry, now: float) -> None:
        if isinstance(entry, GroupAction):
            group = self.groups.get((entry.subject, entry.key))
            if group is None:  # a retry subject's group is made by its first pull
                group = self.groups[(entry.subject, entry.key)] = ConsumerGroup(entry.subject, entry.key)
            group.apply(entry.action)
            if not isinstance(entry.action, Reset) and entry.action.consumer in group.consumers:
                group.consumers[entry.action.consumer].last_seen = now
        elif isinstance(entry, Create):
            self.groups[(entry.subject, entry.key)] = ConsumerGroup(
                entry.subject, entry.key, entry.cursor, entry.broadcast
            )
        elif isinstance(entry, Schedule):
            self.retries.add(entry)
        elif isinstance(entry, Fired):
            self.retries.fired(entry.ids)
        elif isinstance(entry, Redriven):
            self._dead_handled(entry.dead_subject, entry.upto, entry.seqs)
            self.leases.redriven(entry.dead_subject, entry.purged)
        elif isinstance(entry, Leased):
            self.leases.apply(entry, now)
        elif isinstance(entry, KeyStopped):
            self.leases.stop(entry)
        elif isinstance(entry, Delete):
            self.groups.pop((entry.subject, entry.key), None)
            retry = retry_subject(entry.subject, entry.key)
            if entry.retry_cursor:
                self.groups[(retry, entry.key)] = ConsumerGroup(retry, entry.key, entry.retry_cursor)
            else:
                self.groups.pop((retry, entry.key), None)
            self._dead_handled(dead_subject(entry.subject, entry.key), entry.dead_upto, ())

    def _dead_handled(self, dead: str, upto: int, seqs: tuple[int, ...]) -> None:
        """Dead letters below `upto` and at `seqs` are handled; the mark moves over a handled run."""
        mark = max(self.redriven.get(dead, 0), upto)
        done = self.dead_done.setdefault(dead, set())
        done.update(s for s in seqs if s >= mark)
        while mark in done:
            done.discard(mark)
            mark += 1
        done.difference_update([s for s in done if s < mark])
        if not done:
            del self.dead_done[dead]
        self.redriven[dead] = mark

    def dead_pending(self, dead: str, end: int) -> int:
        """Dead letters of `dead` (whose next sequence is `end`) neither re-driven nor purged."""
        return max(0, end - self.redriven.get(dead, 0) - len(self.dead_done.get(dead, ())))

    def dead_is_done(self, dead: str, seq: int) -> bool:
        return seq < self.redriven.get(dead, 0) or seq in self.dead_done.get(dead, ())

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "version": SNAPSHOT_VERSION,
            "journal_seq": self.journal_seq,
            "groups": [g.to_state() for g in self.groups.values()],
            "retries": [
                [e.id, e.due_ms, e.offset, e.attempt, e.retry_subject, e.reason] for e in self.retries.entries()
            ],
            "retry_next_id": self.retries.next_id,
            "redriven": dict(self.redriven),
            "dead_done": {dead: sorted(seqs) for dead, seqs in self.dead_done.items()},
            "leases": self.leases.to_state(),
            "stopped_keys": self.leases.stopped_state(),
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any], now: float) -> BrokerState:
        if data.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {data.get('version')} is not {SNAPSHOT_VERSION}")
        state = cls()
        state.journal_seq = int(data["journal_seq"])
        for group_state in data["groups"]:
            group = ConsumerGroup.from_state(group_state, now)
            state.groups[(group.subject, group.group)] = group
        for item in data["retries"]:
            state.retries.add(Schedule(*item))
        state.retries.next_id = max(state.retries.next_id, int(data["retry_next_id"]))
        state.redriven = {k: int(v) for k, v in data["redriven"].items()}
        state.dead_done = {k: {int(s) for s in v} for k, v in data.get("dead_done", {}).items()}
        state.leases.load(data.get("leases", []), now, data.get("stopped_keys", []))
        return state
