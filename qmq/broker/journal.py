"""The action journal: every change to consumption state, as records of the store's `%ACTION%` subject.

Pulls, acks, releases, resets, retry schedules and re-drives are appended here in the order they were
applied, in the same message log as the messages, so one group commit makes a batch of messages and
the pulls that handed them out durable together, and recovery cuts both at the same point. After a
restart the broker loads its last snapshot and replays the journal from the sequence it names.

An entry is a msgpack list whose first element names the action; one record holds a list of entries.
Consume-log sequences in a pull are stored as runs `[first, count]`, so a pull of 1,000 messages in a
row costs a few bytes. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from qmq.broker.consumer_group import Ack, Pull, Release, Reset
from qmq.broker.queue_lease import KeyStopped, Leased

CREATE, RESET, PULL, ACK, RELEASE, SCHEDULE, FIRED, REDRIVEN, DELETE = "C", "R", "P", "A", "L", "S", "F", "D", "X"
LEASED = "Q"  # a queue lease of an ordered subject changed hands (qmq/broker/queue_lease.py)
KEY_STOPPED = "K"  # an order key stopped at a poison message (on_poison="stop")


@dataclass(frozen=True)
class Create:
    """A consumer group's first pull of `subject`: where it starts, and whether it is a broadcast
    consumer (then the group key names the consumer too, and it is never released)."""

    subject: str
    key: str
    cursor: int
    broadcast: bool


@dataclass(frozen=True)
class GroupAction:
    """A `consumer_group` action on the group `key` of the stored subject `subject`."""

    subject: str
    key: str
    action: Pull | Ack | Release | Reset


@dataclass(frozen=True)
class Schedule:
    """The record at `offset` comes back to its group through `retry_subject` at `due_ms`."""

    id: int
    due_ms: int
    offset: int
    attempt: int
    retry_subject: str
    reason: str = ""


@dataclass(frozen=True)
class Fired:
    """Schedules appended to their retry subjects."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Redriven:
    """Dead letters of `dead_subject` below `upto`, and those at sequences `seqs`, were sent back to
    their group, or thrown away (`purged`, `qmq admin dead purge`)."""

    dead_subject: str
    upto: int
    seqs: tuple[int, ...] = ()
    purged: bool = False


@dataclass(frozen=True)
class Delete:
    """The consumer group `key` of `subject` was deleted (`qmq admin group delete`): its position and
    pull logs are gone, its retry subject is skipped up to `retry_cursor` and its dead letters below
    `dead_upto` are dropped, so a group made again under the name starts clean."""

    subject: str
    key: str
    retry_cursor: int
    dead_upto: int


Entry = Create | GroupAction | Schedule | Fired | Redriven | Delete | Leased | KeyStopped


def runs(seqs: tuple[int, ...] | list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for seq in seqs:
        if out and out[-1][0] + out[-1][1] == seq:
            out[-1][1] += 1
        else:
            out.append([seq, 1])
    return out


def unruns(pairs: list[list[int]]) -> tuple[int, ...]:
    return tuple(seq for first, count in pairs for seq in range(first, first + count))


def _to_list(entry: Entry) -> list[Any]:
    if isinstance(entry, Create):
        return [CREATE, entry.subject, entry.key, entry.cursor, entry.broadcast]
    if isinstance(entry, GroupAction):
        a = entry.action
        if isinstance(a, Pull):
            return [PULL, entry.subject, entry.key, a.consumer, a.first_pull, runs(a.seqs), a.cursor]
        if isinstance(a, Ack):
            return [ACK, entry.subject, entry.key, a.consumer, a.last_pull]
        if isinstance(a, Release):
            return [RELEASE, entry.subject, entry.key, a.consumer, a.last_pull]
        return [RESET, entry.subject, entry.key, a.cursor]
    if isinstance(entry, Schedule):
        return [SCHEDULE, entry.id, entry.due_ms, entry.offset, entry.attempt, entry.retry_subject, entry.reason]
    if isinstance(entry, Fired):
        return [FIRED, list(entry.ids)]
    if isinstance(entry, Delete):
        return [DELETE, entry.subject, entry.key, entry.retry_cursor, entry.dead_upto]
    if isinstance(entry, Leased):
        return [LEASED, entry.subject, entry.key, entry.consumer]
    if isinstance(entry, KeyStopped):
        return [KEY_STOPPED, entry.subject, entry.key, entry.order_key]
    if entry.seqs or entry.purged:  # older brokers read the first three fields of a plain re-drive
        return [REDRIVEN, entry.dead_subject, entry.upto, runs(entry.seqs), entry.purged]
    return [REDRIVEN, entry.dead_subject, entry.upto]


def _from_list(item: list[Any]) -> Entry:
    kind = item[0]
    if kind == CREATE:
        return Create(item[1], item[2], item[3], bool(item[4]))
    if kind == PULL:
        return GroupAction(item[1], item[2], Pull(item[3], item[4], unruns(item[5]), item[6]))
    if kind == ACK:
        return GroupAction(item[1], item[2], Ack(item[3], item[4]))
    if kind == RELEASE:
        return GroupAction(item[1], item[2], Release(item[3], item[4]))
    if kind == RESET:
        return GroupAction(item[1], item[2], Reset(item[3]))
    if kind == SCHEDULE:
        return Schedule(*item[1:7])
    if kind == FIRED:
        return Fired(tuple(item[1]))
    if kind == REDRIVEN:
        if len(item) > 3:
            return Redriven(item[1], item[2], unruns(item[3]), bool(item[4]))
        return Redriven(item[1], item[2])
    if kind == DELETE:
        return Delete(item[1], item[2], item[3], item[4])
    if kind == LEASED:
        return Leased(item[1], item[2], item[3])
    if kind == KEY_STOPPED:
        return KeyStopped(item[1], item[2], item[3])
    raise ValueError(f"unknown journal entry kind {kind!r}")


def encode(entries: list[Entry]) -> bytes:
    return msgpack.packb([_to_list(e) for e in entries], use_bin_type=True)


def decode(payload: bytes) -> list[Entry]:
    """The entries of one journal record; ValueError for a record this version cannot read."""
    try:
        items = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return [_from_list(item) for item in items]
    except (ValueError, TypeError, LookupError, msgpack.UnpackException) as exc:
        raise ValueError(f"unreadable journal record: {exc}") from exc
