"""Leases on the logical queues of ordered subjects (docs/ordering.md), without I/O or a clock.

Per (queue subject `subject#queue`, consumer group) at most one consumer holds the lease; only the
holder is handed the queue's messages (qmq/broker/ordered.py checks every pull). A lease lasts
`lease_s` from its grant or last renewal; a holder that stops renewing (crashed, stopped, cut off)
loses it once it expired, never before, and only then may another consumer of the group take it.

Who holds a lease is journalled (`Leased` entries in the `%ACTION%` journal, in snapshots too), so a
restarted broker keeps every holder and gives each its whole `lease_s` again to come back. Renewals
are not journalled: they only move the expiry, which a restart resets anyway.

Handing a queue to a new holder (`handover`) gives back what earlier holders were handed and did not
acknowledge (the new holder's own included, when it lost the lease and got it back): their pull
logs are released and the group's cursor goes back to the oldest such
message, so the new holder receives the queue from there, in order, before anything newer. A queue's
messages are therefore handled in consume-log order by one consumer at a time; what the earlier
holder finished without acknowledging is delivered once more (idempotent consumers drop it).
"""

from __future__ import annotations

from dataclasses import dataclass

from qmq.broker.consumer_group import ConsumerGroup, Release, Reset

ORDERED_LEASE_S = 20.0  # a queue lease lasts this long after its grant or last renewal


@dataclass(frozen=True)
class Leased:
    """Journal entry: `consumer` now holds the lease of queue subject `subject` for group `key`
    (`consumer` empty: nobody does, it was released)."""

    subject: str
    key: str
    consumer: str


@dataclass(frozen=True)
class KeyStopped:
    """Journal entry: `order_key` of queue subject `subject` stopped for group `key` at a poison
    message (`on_poison="stop"`): whoever holds the queue parks the key's messages until the
    queue's dead letters are re-driven, which lets every stopped key of the queue go on."""

    subject: str
    key: str
    order_key: str


class QueueLeases:
    """Every queue lease of a broker, and the consumers asking for them (the members, by group)."""

    def __init__(self, lease_s: float = ORDERED_LEASE_S) -> None:
        self.lease_s = lease_s
        self.holders: dict[tuple[str, str], str] = {}  # (queue subject, group) -> consumer
        self.expires: dict[tuple[str, str], float] = {}  # same key -> when the lease runs out
        self._members: dict[tuple[str, str], dict[str, float]] = {}  # (subject, group) -> consumer -> seen
        self.stopped: dict[tuple[str, str], set[str]] = {}  # (queue subject, group) -> stopped order keys

    def set_lease_s(self, lease_s: float, now: float) -> None:
        """Leases last `lease_s` from now on; every lease held gets it whole (after a restart)."""
        self.lease_s = lease_s
        for key in self.expires:
            self.expires[key] = now + lease_s

    def apply(self, entry: Leased, now: float) -> None:
        """A journal entry, live or replayed (a replayed holder gets its whole lease again)."""
        key = (entry.subject, entry.key)
        if entry.consumer:
            self.holders[key] = entry.consumer
            self.expires[key] = now + self.lease_s
        else:
            self.holders.pop(key, None)
            self.expires.pop(key, None)

    def holder(self, subject: str, key: str, now: float) -> str | None:
        """The consumer holding the queue's lease now, None when nobody does (or it expired)."""
        consumer = self.holders.get((subject, key))
        if consumer is None or self.expires.get((subject, key), 0.0) <= now:
            return None
        return consumer

    def held_by(self, subject: str, key: str, consumer: str, now: float) -> bool:
        return self.holder(subject, key, now) == consumer

    def renew(self, subject: str, key: str, now: float) -> None:
        self.expires[(subject, key)] = now + self.lease_s

    def last_holder(self, subject: str, key: str) -> str | None:
        """Who held the lease last, expired or not."""
        return self.holders.get((subject, key))

    # ---- keys stopped at a poison message ----------------------------------------------------------------

    def stop(self, entry: KeyStopped) -> None:
        self.stopped.setdefault((entry.subject, entry.key), set()).add(entry.order_key)

    def redriven(self, dead: str, purged: bool) -> None:
        """The dead letters of `dead` (`%DEAD%subject#queue%group`) were re-driven: the queue's stopped
        keys go on (their parked messages come back first, in order). A purge leaves them stopped."""
        if purged or not dead.startswith("%DEAD%"):
            return
        subject, _, group = dead[len("%DEAD%") :].rpartition("%")
        self.stopped.pop((subject, group), None)

    def stopped_keys(self, subject: str, key: str) -> set[str]:
        return self.stopped.get((subject, key), set())

    # ---- members ----------------------------------------------------------------------------------

    def seen(self, subject: str, key: str, consumer: str, now: float) -> None:
        self._members.setdefault((subject, key), {})[consumer] = now

    def left(self, subject: str, key: str, consumer: str) -> None:
        self._members.get((subject, key), {}).pop(consumer, None)

    def members(self, subject: str, key: str, now: float) -> list[str]:
        """The consumers of `subject` in group `key` that asked for leases within a lease's time, sorted
        (a member that stopped asking is dropped when its leases expire: the others then share its
        queues)."""
        seen = self._members.get((subject, key), {})
        for consumer in [c for c, at in seen.items() if now - at > self.lease_s]:
            del seen[consumer]
        return sorted(seen)

    # ---- snapshots ----------------------------------------------------------------------------------

    def to_state(self) -> list[list[str]]:
        return [[subject, key, consumer] for (subject, key), consumer in self.holders.items()]

    def stopped_state(self) -> list[list]:
        return [[subject, key, sorted(keys)] for (subject, key), keys in self.stopped.items() if keys]

    def load(self, state: list[list[str]], now: float, stopped: list[list] | None = None) -> None:
        for subject, key, consumer in state:
            self.apply(Leased(subject, key, consumer), now)
        for subject, key, keys in stopped or ():
            self.stopped[(subject, key)] = set(keys)


def handover(groups: list[ConsumerGroup]) -> list[tuple[ConsumerGroup, Release | Reset]]:
    """The actions that give a queue to a holder anew (not a renewal): for each of its stored
    subjects' `groups` (the queue subject and its retry subject), every consumer's unacknowledged
    messages are released, the new holder's own included (it may have dropped them meanwhile), and
    the cursor goes back to the oldest of them. Not applied: the caller applies and journals them."""
    out: list[tuple[ConsumerGroup, Release | Reset]] = []
    for group in groups:
        oldest: int | None = None
        for consumer_id, consumer in group.consumers.items():
            log = consumer.pull_log
            if not log.unacked:
                continue
            pending = log.pending()
            oldest = min(pending) if oldest is None else min(oldest, *pending)
            out.append((group, Release(consumer_id, log.pull_seq - 1)))
        if oldest is not None and oldest < group.cursor:
            out.append((group, Reset(oldest)))
    return out
