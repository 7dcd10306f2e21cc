"""Everything a broker knows about consumption: every consumer group of every stored subject, the
retry schedule and how far each dead-letter subject was re-driven.

It changes only through journal entries (`apply`), live or replayed, so the state after a restart is
the last snapshot plus the journal after it. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from typing import Any

from qmq.broker.consumer_group import ConsumerGroup, Reset
from qmq.broker.journal import Create, Entry, Fired, GroupAction, Redriven, Schedule
from qmq.broker.retry import RetrySchedule

SNAPSHOT_VERSION = 1


class BrokerState:
    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], ConsumerGroup] = {}  # (stored subject, group key) -> group
        self.retries = RetrySchedule()
        self.redriven: dict[str, int] = {}  # dead subject -> first sequence not yet re-driven
        self.journal_seq = 0  # the next journal sequence to apply (what a snapshot covers)

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
            self.redriven[entry.dead_subject] = max(self.redriven.get(entry.dead_subject, 0), entry.upto)

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
        return state
