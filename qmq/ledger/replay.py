"""A broker's message log, replayed into ledger rows: every message stored, the consumer groups of
each subject, and per (message, consumer group) what happened to it. Nothing here does I/O.

Records are fed in log order. Messages and their retry and dead-letter copies are records of their
subjects; everything a consumer did is in the action journal (`%ACTION%`, qmq/broker/journal.py):
a pull hands out consume-log sequences of a stored subject, numbered in the consumer's pull log; an
ack (a prefix of that pull log) acknowledges them; a release gives them back (their copies went to
the retry subject first); a schedule says a delivery failed and comes back later. So the fate of a
message in a group is decided by the last of these events: a dead-letter copy (dead), a failure or
a retry copy (retrying), or a delivery, acknowledged (acked) or not (in flight).

Only messages first stored within the window are followed. A journal whose start was removed by
retention refers to pulls never seen: they are ignored, as are the messages they handed out.

Memory is what a day's export of a busy broker needs: message rows go to a sink as they are read,
and what is kept per message is its id and a few numbers in arrays, per subject and per consumer
group (some 300 bytes a message with one or two groups), not an object per message.
"""

from __future__ import annotations

import bisect
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from qmq.broker import journal
from qmq.broker.consumer_group import Ack, Pull, Release
from qmq.broker.system_subjects import WRAPPED, unwrap
from qmq.ledger import tables as t
from qmq.protocol import envelope
from qmq.protocol.limits import ACTION_SUBJECT
from qmq.store.record import Record

REDRIVE_REASON = "re-driven"  # what the broker writes on a dead letter it sends back (qmq/broker/service.py)
MS_PER_DAY = 86_400_000
NONE = -1  # "no such time" and "not followed" in the arrays
# Events in the life of a message in a group; the last one decides its status.
DELIVERED, FAILED, COPIED, DEAD = 1, 2, 3, 4

Row = dict[str, Any]


def day_of(ms: int) -> str:
    """The UTC date (`YYYY-MM-DD`) of a time in ms: a ledger partition."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d")


@dataclass(frozen=True)
class Window:
    """Messages first stored in [since_ms, until_ms) are exported; None: unbounded."""

    since_ms: int | None = None
    until_ms: int | None = None

    def __contains__(self, ms: int) -> bool:
        return (self.since_ms is None or ms >= self.since_ms) and (self.until_ms is None or ms < self.until_ms)


EVERYTHING = Window()


def parse_system_subject(stored: str) -> tuple[str, str, str] | None:
    """`%RETRY%s%g` -> ("RETRY", s, g); None for a user subject or the journal."""
    if not stored.startswith("%") or stored == ACTION_SUBJECT:
        return None
    kind, subject, group = stored[1:].split("%", 2)
    return kind, subject, group


def _grow(values: array, size: int, fill: int) -> None:
    if len(values) < size:
        values.extend([fill] * (size - len(values)))


class _Fates:
    """What happened to each message of one subject (by its number in the subject) in one group."""

    def __init__(self) -> None:
        self.delivered, self.open, self.attempts = array("i"), array("i"), array("i")
        self.last = array("b")
        self.first_ms, self.last_ms, self.acked_ms, self.dead_ms = array("q"), array("q"), array("q"), array("q")

    def reach(self, n: int) -> None:
        """Make room for message number `n`."""
        size = n + 1
        if len(self.last) >= size:
            return
        for counts in (self.delivered, self.open, self.attempts, self.last):
            _grow(counts, size, 0)
        for times in (self.first_ms, self.last_ms, self.acked_ms, self.dead_ms):
            _grow(times, size, NONE)

    def status(self, n: int) -> str:
        last = self.last[n]
        if last == DEAD:
            return t.DEAD_LETTERED
        if last in (FAILED, COPIED):
            return t.RETRYING
        return t.ACKED if self.open[n] == 0 and self.acked_ms[n] != NONE else t.IN_FLIGHT


@dataclass
class _Subject:
    """The followed messages of one producer subject, numbered in the order they were stored."""

    name: str
    ids: list[str] = field(default_factory=list)
    first_stored_ms: array = field(default_factory=lambda: array("q"))
    number: dict[str, int] = field(default_factory=dict)  # message id -> number (a copy finds its original)
    groups: dict[str, _Fates] = field(default_factory=dict)

    def add(self, message_id: str, stored_ms: int) -> int:
        n = self.number.get(message_id)
        if n is None:  # a message stored twice (a producer's retry) is one message
            n = self.number[message_id] = len(self.ids)
            self.ids.append(message_id)
            self.first_stored_ms.append(stored_ms)
        return n

    def fates(self, group: str, n: int) -> _Fates:
        fates = self.groups.get(group)
        if fates is None:
            fates = self.groups[group] = _Fates()
        fates.reach(n)
        return fates


@dataclass
class _Seqs:
    """What a stored subject's consume-log sequences hold: a message number of `subject` (NONE for a
    record not followed) and, for a copy, the attempt it is."""

    subject: _Subject
    first_seq: int
    numbers: array = field(default_factory=lambda: array("q"))
    attempts: array = field(default_factory=lambda: array("i"))

    def put(self, seq: int, n: int, attempt: int) -> None:
        while self.first_seq + len(self.numbers) < seq:  # a hole left by a repaired record
            self.numbers.append(NONE)
            self.attempts.append(0)
        self.numbers.append(n)
        self.attempts.append(attempt)

    def get(self, seq: int) -> tuple[int, int]:
        i = seq - self.first_seq
        return (self.numbers[i], self.attempts[i]) if 0 <= i < len(self.numbers) else (NONE, 0)


class BrokerLedger:
    """Feed it a broker's records in log order (`feed`); message rows go to `on_message` as they are
    read; then take the delivery rows (`delivery_rows`) and the groups (`group_rows`)."""

    def __init__(self, window: Window = EVERYTHING, on_message: Callable[[Row], None] | None = None) -> None:
        self.window = window
        self.message_rows: list[Row] = []
        self.on_message = on_message or self.message_rows.append
        self._subjects: dict[str, _Subject] = {}
        self._seqs: dict[str, _Seqs] = {}
        self._offsets = array("q")  # message-log offsets of followed records, ascending...
        self._numbers = array("q")  # ...and the message number each holds
        self._pending: dict[tuple[str, str, str], deque[tuple[int, _Fates, int]]] = {}
        self._broadcast: dict[str, bool] = {}  # group key -> broadcast
        self.group_rows: list[Row] = []
        self.records = 0
        self.problems: list[str] = []

    def feed_all(self, records: Iterable[Record]) -> None:
        for record in records:
            self.feed(record)

    def feed(self, record: Record) -> None:
        self.records += 1
        if record.subject == ACTION_SUBJECT:
            try:
                entries = journal.decode(record.payload)
            except ValueError as exc:  # a newer broker's entry, say: the rest of the journal still counts
                self.problems.append(f"journal record at offset {record.offset} skipped: {exc}")
                return
            for entry in entries:
                self._apply(entry, record.store_ts)
            return
        system = parse_system_subject(record.subject)
        if system is None:
            self._original(record)
        else:
            self._copy(record, *system)

    # ---- messages and copies -------------------------------------------------------------------

    def _subject(self, name: str) -> _Subject:
        subject = self._subjects.get(name)
        if subject is None:
            subject = self._subjects[name] = _Subject(name)
        return subject

    def _remember(self, record: Record, subject: _Subject, n: int, attempt: int) -> None:
        seqs = self._seqs.get(record.subject)
        if seqs is None:
            seqs = self._seqs[record.subject] = _Seqs(subject, record.seq)
        seqs.put(record.seq, n, attempt)
        if n != NONE:
            self._offsets.append(record.offset)
            self._numbers.append(n)

    def _original(self, record: Record) -> None:
        subject = self._subject(record.subject)
        if record.store_ts not in self.window:
            self._remember(record, subject, NONE, 0)
            return
        self._remember(record, subject, subject.add(record.message_id, record.store_ts), 1)
        env = envelope.decode(record.payload)
        self.on_message(
            {
                "message_id": record.message_id,
                "subject": subject.name,
                "stored_subject": subject.name,
                "group": None,
                "origin": t.PRODUCER,
                "attempt": 1,
                "reason": None,
                "stored_at": record.store_ts,
                "first_stored_at": record.store_ts,
                "created_at": env.created_at,
                "producer": env.headers.get(t.PRODUCER_HEADER),
                "size": len(env.raw),
                "offset": record.offset,
            }
        )

    def _copy(self, record: Record, kind: str, subject_name: str, group: str) -> None:
        subject = self._subject(subject_name)
        n = subject.number.get(record.message_id, NONE) if record.flags & WRAPPED else NONE
        if n == NONE:  # a copy of a message not followed
            self._remember(record, subject, NONE, 0)
            return
        wrapped = unwrap(record)
        self._remember(record, subject, n, wrapped.attempt)
        origin = t.DEAD if kind == "DEAD" else t.REDRIVEN if wrapped.reason == REDRIVE_REASON else t.RETRY
        self.on_message(
            {
                "message_id": record.message_id,
                "subject": subject.name,
                "stored_subject": record.subject,
                "group": group,
                "origin": origin,
                "attempt": wrapped.attempt,
                "reason": wrapped.reason or None,
                "stored_at": record.store_ts,
                "first_stored_at": subject.first_stored_ms[n],
                "created_at": None,
                "producer": None,
                "size": len(wrapped.payload),
                "offset": record.offset,
            }
        )
        fates = subject.fates(group, n)
        fates.last[n] = DEAD if kind == "DEAD" else COPIED
        if kind == "DEAD":
            fates.dead_ms[n] = record.store_ts

    # ---- the journal ---------------------------------------------------------------------------

    def _apply(self, entry: journal.Entry, ms: int) -> None:
        if isinstance(entry, journal.GroupAction):
            action = entry.action
            if isinstance(action, Pull):
                self._pulled(entry.subject, entry.key, action, ms)
            elif isinstance(action, Ack | Release):
                self._settled(
                    entry.subject, entry.key, action.consumer, action.last_pull, ms, acked=isinstance(action, Ack)
                )
        elif isinstance(entry, journal.Create):
            self._broadcast[entry.key] = entry.broadcast
            if parse_system_subject(entry.subject) is None:
                self.group_rows.append(
                    {
                        "subject": entry.subject,
                        "group": entry.key,
                        "broadcast": entry.broadcast,
                        "created_at": ms,
                        "start_seq": entry.cursor,
                    }
                )
        elif isinstance(entry, journal.Schedule):
            self._failed(entry)

    def _pulled(self, stored_subject: str, key: str, pull: Pull, ms: int) -> None:
        seqs = self._seqs.get(stored_subject)
        if seqs is None:
            return
        pending = self._pending.setdefault((stored_subject, key, pull.consumer), deque())
        fates = None
        for i, seq in enumerate(pull.seqs):
            n, attempt = seqs.get(seq)
            if n == NONE:
                continue
            fates = fates or seqs.subject.fates(key, n)
            fates.reach(n)
            fates.delivered[n] += 1
            fates.open[n] += 1
            fates.attempts[n] = max(fates.attempts[n], attempt)
            if fates.first_ms[n] == NONE:
                fates.first_ms[n] = ms
            fates.last_ms[n] = ms
            fates.last[n] = DELIVERED
            pending.append((pull.first_pull + i, fates, n))

    def _settled(self, stored_subject: str, key: str, consumer: str, last_pull: int, ms: int, *, acked: bool) -> None:
        pending = self._pending.get((stored_subject, key, consumer))
        while pending and pending[0][0] <= last_pull:
            _, fates, n = pending.popleft()
            fates.open[n] -= 1
            if acked:
                fates.acked_ms[n] = ms

    def _failed(self, schedule: journal.Schedule) -> None:
        i = bisect.bisect_left(self._offsets, schedule.offset)
        system = parse_system_subject(schedule.retry_subject)
        if i == len(self._offsets) or self._offsets[i] != schedule.offset or system is None:
            return
        _, subject_name, group = system
        n = self._numbers[i]
        self._subject(subject_name).fates(group, n).last[n] = FAILED

    # ---- rows ----------------------------------------------------------------------------------

    def delivery_rows(self) -> Iterator[Row]:
        """One row per (message, group) with anything to say, subject by subject."""
        for subject in self._subjects.values():
            for group, fates in subject.groups.items():
                broadcast = self._broadcast.get(group, False)
                for n in range(len(fates.last)):
                    if not fates.delivered[n] and not fates.last[n]:
                        continue
                    status = fates.status(n)
                    yield {
                        "message_id": subject.ids[n],
                        "subject": subject.name,
                        "group": group,
                        "broadcast": broadcast,
                        "times_delivered": fates.delivered[n],
                        "first_delivered_at": _ms(fates.first_ms[n]),
                        "last_delivered_at": _ms(fates.last_ms[n]),
                        "acked_at": _ms(fates.acked_ms[n]),
                        "status": status,
                        "dead_lettered": status == t.DEAD_LETTERED,
                        "dead_lettered_at": _ms(fates.dead_ms[n]),
                        "attempts": fates.attempts[n],
                        "first_stored_at": subject.first_stored_ms[n],
                    }


def _ms(value: int) -> int | None:
    return None if value == NONE else value
