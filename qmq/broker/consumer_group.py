"""A consumer group on one subject: the group's shared cursor and every consumer's pull log.

QMQ's consumption model, without partitions: each pull claims the next slice of the subject's consume
log for the puller, so any number of consumers share a backlog and a new one helps at once. A consumer
that lost messages it was handed (its process restarted, or a reply was lost) gets them again first:
its pull request says the last pull sequence it saw, and anything after it is resent. A consumer
silent for too long gives its unacknowledged messages back (the broker moves them to the group's retry
subject, where the rest of the group consumes them).

Every change is an action (`Pull`, `Ack`, `Release`, `Reset`) performed by `apply`. The broker journals
each action in its action log and replays the journal after a restart, so positions and pull logs
survive a crash. Nothing here does I/O or reads a clock; callers pass `now`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from qmq.broker.pull_log import PullLog

# (from consume-log seq, max count) -> (matching seqs ascending, the cursor after them)
Reader = Callable[[int, int], tuple[list[int], int]]


@dataclass(frozen=True)
class Pull:
    consumer: str
    first_pull: int
    seqs: tuple[int, ...]
    cursor: int  # the group's cursor after this pull


@dataclass(frozen=True)
class Ack:
    consumer: str
    last_pull: int


@dataclass(frozen=True)
class Release:
    """The consumer's unacknowledged messages up to `last_pull` were given back to the group."""

    consumer: str
    last_pull: int


@dataclass(frozen=True)
class Reset:
    cursor: int


Action = Pull | Ack | Release | Reset


@dataclass(frozen=True)
class Delivery:
    """What a pull hands out: consume-log `seqs`, numbered `first_pull`, `first_pull + 1`, ..."""

    first_pull: int
    seqs: list[int]
    resent: bool = False


class UnknownConsumer(KeyError):
    pass


@dataclass
class Consumer:
    pull_log: PullLog = field(default_factory=PullLog)
    last_seen: float = 0.0


class ConsumerGroup:
    def __init__(self, subject: str, group: str, cursor: int = 0, broadcast: bool = False) -> None:
        self.subject = subject
        self.group = group
        self.cursor = cursor  # the next consume-log sequence no consumer of the group has been handed
        self.broadcast = broadcast  # one consumer, with its own position: never released to others
        self.consumers: dict[str, Consumer] = {}

    def to_state(self) -> dict:
        """A msgpack-able copy, for snapshots (times last seen are not kept: after a restart every
        consumer gets the whole timeout to come back)."""
        return {
            "subject": self.subject,
            "group": self.group,
            "cursor": self.cursor,
            "broadcast": self.broadcast,
            "consumers": {cid: c.pull_log.to_state() for cid, c in self.consumers.items()},
        }

    @classmethod
    def from_state(cls, state: dict, now: float) -> ConsumerGroup:
        group = cls(state["subject"], state["group"], int(state["cursor"]), bool(state["broadcast"]))
        for cid, pull_log in state["consumers"].items():
            group.consumers[cid] = Consumer(PullLog.from_state(pull_log), now)
        return group

    def apply(self, action: Action) -> None:
        """Perform an action, live or replayed from the action log."""
        if isinstance(action, Pull):
            consumer = self.consumers.setdefault(action.consumer, Consumer())
            if action.first_pull != consumer.pull_log.pull_seq:
                raise ValueError(f"{action}: the pull log of {action.consumer} is at {consumer.pull_log.pull_seq}")
            consumer.pull_log.append(list(action.seqs))
            self.cursor = max(self.cursor, action.cursor)
        elif isinstance(action, Ack | Release):
            self._consumer(action.consumer).pull_log.ack(action.last_pull)
        elif isinstance(action, Reset):
            self.cursor = action.cursor

    def pull(
        self, consumer_id: str, client_pulled: int, max_count: int, read: Reader, now: float
    ) -> tuple[Delivery, Pull | None]:
        """Hand `consumer_id` up to `max_count` messages. `client_pulled` is the last pull sequence the
        consumer has received (-1 for none, as after a restart). Returns the delivery and the action
        to journal (None when nothing changed); the action is already applied."""
        consumer = self.consumers.get(consumer_id)
        if consumer is not None:
            consumer.last_seen = now
            log = consumer.pull_log
            resend_from = max(client_pulled + 1, log.ack_seq)
            if resend_from < log.pull_seq:
                last = min(log.pull_seq - 1, resend_from + max_count - 1)
                return Delivery(resend_from, log.lookup(resend_from, last), resent=True), None
        seqs, cursor = read(self.cursor, max_count)
        if not seqs:
            self.cursor = cursor  # skipped by a filter: not worth a journal entry, re-skipped on replay
            return Delivery(consumer.pull_log.pull_seq if consumer else 0, []), None
        action = Pull(consumer_id, consumer.pull_log.pull_seq if consumer else 0, tuple(seqs), cursor)
        self.apply(action)
        self.consumers[consumer_id].last_seen = now
        return Delivery(action.first_pull, seqs), action

    def next_pull(self, consumer_id: str) -> int:
        """The pull sequence `consumer_id` is handed next. A consumer that names one at or past it as
        received knows pulls this broker does not (a failover's new master that never got its old
        master's last pull entries): it must start over from its acknowledged point before anything
        new is numbered here, or its acks would cover messages it never saw."""
        consumer = self.consumers.get(consumer_id)
        return consumer.pull_log.pull_seq if consumer is not None else 0

    def ack(self, consumer_id: str, last_pull: int, now: float) -> Ack | None:
        """Acknowledge `consumer_id`'s pull sequences up to `last_pull`; the action to journal, or None
        for a repeat. Raises `UnknownConsumer`, or ValueError for a pull sequence never handed out."""
        consumer = self._consumer(consumer_id)
        consumer.last_seen = now
        if last_pull < consumer.pull_log.ack_seq:
            return None
        action = Ack(consumer_id, last_pull)
        self.apply(action)
        return action

    def heartbeat(self, consumer_id: str, now: float) -> None:
        if consumer_id in self.consumers:
            self.consumers[consumer_id].last_seen = now

    def silent(self, now: float, timeout: float) -> list[tuple[Release, list[int]]]:
        """Consumers silent for `timeout` that hold unacknowledged messages: for each, the release to
        journal and the consume-log sequences it gives back. Not applied: the broker first moves the
        messages to the retry subject, then applies the release, so a crash in between resends rather
        than loses."""
        out: list[tuple[Release, list[int]]] = []
        if self.broadcast:
            return out
        for consumer_id, consumer in self.consumers.items():
            log = consumer.pull_log
            if log.unacked and now - consumer.last_seen >= timeout:
                out.append((Release(consumer_id, log.pull_seq - 1), log.pending()))
        return out

    def leaving(self, consumer_id: str, seen: int) -> tuple[Release, list[int], list[int]] | None:
        """A consumer that closes gives back what it holds unacknowledged: the release to journal, the
        consume-log sequences its application was handed (pull sequences up to `seen`) and those it
        never saw (fetched ahead). None when it holds nothing, or in a broadcast group. Not applied,
        as in `silent`."""
        consumer = self.consumers.get(consumer_id)
        if self.broadcast or consumer is None or not consumer.pull_log.unacked:
            return None
        log = consumer.pull_log
        last = log.pull_seq - 1
        split = min(max(seen, log.ack_seq - 1), last)  # the last pull sequence the application saw
        handed = log.lookup(log.ack_seq, split) if split >= log.ack_seq else []
        unseen = log.lookup(split + 1, last) if split < last else []
        return Release(consumer_id, last), handed, unseen

    def backlog(self, end_seq: int) -> int:
        """Messages not yet handed to any consumer."""
        return max(0, end_seq - self.cursor)

    def in_flight(self) -> int:
        """Messages handed out and not acknowledged."""
        return sum(c.pull_log.unacked for c in self.consumers.values())

    def _consumer(self, consumer_id: str) -> Consumer:
        consumer = self.consumers.get(consumer_id)
        if consumer is None:
            raise UnknownConsumer(f"{consumer_id!r} never pulled from {self.subject!r} as group {self.group!r}")
        return consumer
