"""BROKER_LOOKUP (`qmq admin lookup`): a message found by id or by (subject, key), with its life on
this broker, read back from the store and the action journal.

A message's copies share its id: the producer's record, one copy in `%RETRY%subject%group` per
retry, one in `%DEAD%subject%group` per dead letter (and per re-drive). The key index finds them
all; the journal after the first says what happened to each: which consumer of which group pulled
it, whether it was acknowledged, released by a silent consumer, scheduled for a retry, re-driven or
purged. `MessageLife` does that reading without I/O; `lookup` feeds it from the store, off the event
loop (a journal read is bounded by MAX_JOURNAL_RECORDS records: `truncated` says when it stopped).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from qmq.broker import journal
from qmq.broker.consumer_group import Ack, Pull, Release
from qmq.broker.core import BrokerCore
from qmq.broker.journal import Delete, Entry, GroupAction, Redriven, Schedule
from qmq.broker.system_subjects import REDRIVEN_REASON, delivery, unwrap
from qmq.protocol.fields import bad
from qmq.protocol.fields import field as body_field
from qmq.protocol.limits import ACTION_SUBJECT, MAX_KEY_LEN, MAX_MESSAGE_ID_LEN, validate_subject
from qmq.store import record as rec
from qmq.store.store import LogStore

MAX_JOURNAL_RECORDS = 200_000  # journal records read for one look-up, at most
JOURNAL_BATCH = 256  # journal records read at a time
MAX_KEY_MATCHES = 20  # messages of one (subject, key) looked up, newest first
END = 1 << 62  # past any log offset

# What became of a message in one consumer group, by the last thing that happened to it there.
WAITING, IN_FLIGHT, CONSUMED, RETRYING, DEAD, PURGED, DELETED = (
    "waiting",
    "in flight",
    "consumed",
    "retrying",
    "dead",
    "purged",
    "group deleted",
)


def parse_system_subject(stored: str) -> tuple[str, str, str]:
    """(`"retry"`, `"dead"` or `""`, subject, group key) of a stored subject's kind: `%RETRY%s%g` ->
    ("retry", "s", "g"); a producer's subject -> ("", subject, "")."""
    if stored.startswith("%RETRY%") or stored.startswith("%DEAD%"):
        kind, subject, group = stored[1:].split("%")
        return kind.lower(), subject, group
    return "", stored, ""


@dataclass
class _Pulled:
    copy_offset: int
    pull_seq: int
    nacked: bool = False


@dataclass
class MessageLife:
    """One message's copies and what the journal says happened to them, without I/O: `add_copy` each
    record with the message's id (oldest first), then `feed` every journal record written after the
    first, in log order; `events` and `groups` are the answer. A copy counts where it lies in the
    log, among the journal's records: a dead letter settles the pull it came from."""

    copies: list[rec.Record] = field(default_factory=list)
    _events: list[tuple[int, int, dict[str, Any]]] = field(default_factory=list)  # (log offset, n, event)
    _by_seq: dict[tuple[str, int], rec.Record] = field(default_factory=dict)  # (stored subject, seq) -> copy
    _offsets: set[int] = field(default_factory=set)
    _pending: dict[tuple[str, str, str], list[_Pulled]] = field(default_factory=dict)
    _status: dict[str, str] = field(default_factory=dict)  # group key -> what became of the message there
    _arrived: int = 0  # copies already placed among the events
    _purged_offsets: set[int] = field(default_factory=set)

    def add_copy(self, record: rec.Record) -> None:
        """A record with the message's id (added oldest first, before any `feed`)."""
        self.copies.append(record)
        self._by_seq[(record.subject, record.seq)] = record
        self._offsets.add(record.offset)

    def _arrive(self, upto: int) -> None:
        """The copies stored before log offset `upto`, in log order among the journal's events."""
        while self._arrived < len(self.copies) and self.copies[self._arrived].offset < upto:
            record = self.copies[self._arrived]
            self._arrived += 1
            kind, _subject, group = parse_system_subject(record.subject)
            wrapped = unwrap(record)
            event: dict[str, Any] = {"event": "stored", "subject": record.subject, "seq": record.seq}
            if kind == "retry":
                name = "re-driven" if wrapped.reason == REDRIVEN_REASON else "retry"
                event.update(event=name, group=group, attempt=wrapped.attempt, reason=wrapped.reason)
                self._status[group] = RETRYING
            elif kind == "dead":
                event.update(event="dead", group=group, attempt=wrapped.attempt, reason=wrapped.reason)
                self._status[group] = DEAD
                self._nacked(group)
            self._add(record.offset, record.store_ts, event)

    def feed(self, offset: int, at_ms: int, entries: list[Entry]) -> None:
        """The journal record at log `offset`, written at `at_ms`."""
        self._arrive(offset)
        for entry in entries:
            if isinstance(entry, GroupAction):
                self._group_action(offset, at_ms, entry)
            elif isinstance(entry, Schedule) and entry.offset in self._offsets:
                _kind, _subject, group = parse_system_subject(entry.retry_subject)
                self._nacked(group)
                self._status[group] = RETRYING
                self._add(
                    offset,
                    at_ms,
                    {
                        "event": "nacked",
                        "group": group,
                        "attempt": entry.attempt - 1,
                        "reason": entry.reason,
                        "retry_at": entry.due_ms,
                    },
                )
            elif isinstance(entry, Redriven) and entry.purged:
                self._purged(offset, at_ms, entry)
            elif isinstance(entry, Delete) and any(c.subject == entry.subject for c in self.copies):
                self._status[entry.key] = DELETED
                self._add(offset, at_ms, {"event": "group deleted", "group": entry.key})

    def _group_action(self, offset: int, at_ms: int, entry: GroupAction) -> None:
        action, key = entry.action, (entry.subject, entry.key, getattr(entry.action, "consumer", ""))
        _kind, _subject, group = parse_system_subject(entry.subject)
        group = group or entry.key
        if isinstance(action, Pull):
            for i, seq in enumerate(action.seqs):
                copy = self._by_seq.get((entry.subject, seq))
                if copy is not None:
                    pull_seq = action.first_pull + i
                    self._pending.setdefault(key, []).append(_Pulled(copy.offset, pull_seq))
                    self._status[group] = IN_FLIGHT
                    self._add(offset, at_ms, {"event": "pulled", "group": group, "consumer": action.consumer})
        elif isinstance(action, Ack | Release):
            pending = self._pending.get(key, [])
            done = [p for p in pending if p.pull_seq <= action.last_pull]
            self._pending[key] = [p for p in pending if p.pull_seq > action.last_pull]
            for pulled in done:
                if isinstance(action, Release):
                    self._status[group] = RETRYING
                    self._add(offset, at_ms, {"event": "released", "group": group, "consumer": action.consumer})
                elif not pulled.nacked:
                    self._status[group] = CONSUMED
                    self._add(offset, at_ms, {"event": "acked", "group": group, "consumer": action.consumer})

    def _purged(self, offset: int, at_ms: int, entry: Redriven) -> None:
        """A purge of dead letters (a re-drive shows as its retry copy, stored just before)."""
        for copy in self.copies:
            if copy.subject != entry.dead_subject or copy.offset in self._purged_offsets:
                continue
            if copy.seq < entry.upto or copy.seq in entry.seqs:
                _kind, _subject, group = parse_system_subject(copy.subject)
                self._purged_offsets.add(copy.offset)
                if self._status.get(group) == DEAD:  # not re-driven before the mark passed it
                    self._status[group] = PURGED
                    self._add(offset, at_ms, {"event": "purged", "group": group})

    def _nacked(self, group: str) -> None:
        """A nack of the message in `group` (a retry or a dead letter): the ack that follows it
        settles the pull, it does not mean the message was consumed."""
        for (_stored, key, _consumer), pending in self._pending.items():
            if key == group:
                for pulled in pending:
                    pulled.nacked = True

    def _add(self, offset: int, at_ms: int, event: dict[str, Any]) -> None:
        event["at"] = at_ms
        self._events.append((offset, len(self._events), event))

    def events(self) -> list[dict[str, Any]]:
        self._arrive(END)
        return [event for _offset, _n, event in sorted(self._events, key=lambda e: (e[0], e[1]))]

    def groups(self) -> dict[str, str]:
        self._arrive(END)
        return dict(self._status)


def first_journal_seq(store: LogStore, offset: int) -> int:
    """The first journal sequence whose record lies at or after log `offset` (a binary search on the
    journal's consume log)."""
    low, high = store.first_seq(ACTION_SUBJECT), store.next_seq(ACTION_SUBJECT)
    while low < high:
        mid = (low + high) // 2
        entries = store.entries(ACTION_SUBJECT, mid, 1)
        if entries and entries[0] is not None and entries[0].offset < offset:
            low = mid + 1
        else:
            high = mid
    return low


def trace(
    store: LogStore, copies: list[rec.Record], max_records: int = MAX_JOURNAL_RECORDS
) -> tuple[MessageLife, bool]:
    """The life of a message whose copies are `copies` (oldest first); True when the journal was
    longer than `max_records` and the end of the life was not read. Blocking."""
    life = MessageLife()
    for copy in copies:
        life.add_copy(copy)
    seq, end, read = first_journal_seq(store, copies[0].offset), store.next_seq(ACTION_SUBJECT), 0
    while seq < end:
        if read >= max_records:
            return life, True
        result = store.read(ACTION_SUBJECT, seq, min(JOURNAL_BATCH, max_records - read))
        for record in result.records:
            life.feed(record.offset, record.store_ts, journal.decode(record.payload))
        read += len(result.records)
        if result.next_seq == seq:
            break
        seq = result.next_seq
    return life, False


def describe(core: BrokerCore, copies: list[rec.Record], life: MessageLife, truncated: bool) -> dict[str, Any]:
    """One message as BROKER_LOOKUP answers it: the producer's copy (or the oldest one kept), every
    copy, the life, and what became of it in each consumer group of its subject (on the event loop:
    it reads the consumption state)."""
    first = copies[0]
    item = delivery(first)
    item.update(
        {
            "broker_group": core.group_name,
            "stored_subject": first.subject,
            "seq": first.seq,
            "offset": first.offset,
            "copies": [{"subject": c.subject, "seq": c.seq, "at": c.store_ts} for c in copies],
            "life": life.events(),
            "truncated": truncated,
        }
    )
    groups = life.groups()
    if not parse_system_subject(first.subject)[0]:  # groups that never pulled it: waiting, or skipped
        for (stored, key), group in core.state.groups.items():
            if stored == first.subject and key not in groups:
                groups[key] = WAITING if first.seq >= group.cursor else "skipped"
    item["groups"] = groups
    return item


async def lookup(core: BrokerCore, body: dict[str, Any]) -> dict[str, Any]:
    """BROKER_LOOKUP: {"id"} or {"subject", "key"} -> {"messages": [...]} (none when not here)."""
    message_id = body.get("id")
    if message_id is not None:
        if not isinstance(message_id, str) or not 0 < len(message_id.encode()) <= MAX_MESSAGE_ID_LEN:
            raise bad(f"field 'id' must be a message id of 1-{MAX_MESSAGE_ID_LEN} bytes")
        ids = [message_id]
    else:
        subject = validate_subject(body_field(body, "subject", str), limits=core.limits)
        key = body_field(body, "key", str)
        if not 0 < len(key.encode()) <= MAX_KEY_LEN:
            raise bad(f"field 'key' must be 1-{MAX_KEY_LEN} bytes")
        found = await asyncio.to_thread(core.store.find_by_key, subject, key)
        ids = list(dict.fromkeys(r.message_id for r in found))[:MAX_KEY_MATCHES]

    def read() -> list[tuple[list[rec.Record], MessageLife, bool]]:
        out = []
        for one in ids:
            copies = [r for r in core.store.find_all_by_id(one) if r.subject != ACTION_SUBJECT]
            if copies:
                out.append((copies, *trace(core.store, copies)))
        return out

    return {"messages": [describe(core, *found) for found in await asyncio.to_thread(read)]}
