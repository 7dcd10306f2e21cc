"""Ordered consumption at the broker (docs/ordering.md): BROKER_QUEUE_LOCK, and what an ordered pull
(BROKER_PULL with `queues`) may take.

A worker of an ordered consumer asks for the leases of the queues it should hold and gives back
those it should not (BROKER_QUEUE_LOCK, which also renews what it holds and tells who the group's
members are, for the even share). An ordered pull names the queues it holds; the broker hands it only
the messages of queues whose lease it holds now, the queue's retry subject first (re-driven dead
letters), and says which of the named queues it does not hold (`lost`), so the worker stops them.
Granting a queue to a new holder first takes back, in the same journal record, what earlier holders
were handed and did not acknowledge (`queue_lease.handover`), so the queue resumes at its oldest
unacknowledged message.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from qmq.broker.core import BrokerCore
from qmq.broker.journal import Entry, GroupAction
from qmq.broker.queue_lease import Leased, handover
from qmq.broker.system_subjects import retry_subject
from qmq.protocol.fields import bad, field
from qmq.protocol.limits import validate_consumer, validate_group, validate_subject
from qmq.protocol.ordering import ORDERED_QUEUES, queue_subject

if TYPE_CHECKING:
    from qmq.broker.consuming import PullRequest


def ordered_queues(body: dict[str, Any], name: str = "queues") -> tuple[int, ...] | None:
    """The queue numbers a request names (None when it names none: not an ordered pull)."""
    if body.get(name) is None:
        return None
    queues = field(body, name, list)
    for q in queues:
        if not isinstance(q, int) or isinstance(q, bool) or not 0 <= q < ORDERED_QUEUES:
            raise bad(f"{name} must be queue numbers 0-{ORDERED_QUEUES - 1}, got {q!r}")
    return tuple(dict.fromkeys(queues))


def stored_subjects(core: BrokerCore, pull: PullRequest, now: float) -> Iterator[tuple[str, str]]:
    """(retry subject, stored subject) pairs a pull takes from, in order: for a plain pull the
    group's retry subject then the subject; for an ordered pull, for each queue it holds (from a
    random one on, so no queue starves), the queue's retry subject then the queue."""
    if pull.queues is None:
        retry = retry_subject(pull.subject, pull.key)
        yield retry, retry
        yield retry, pull.subject
        return
    queues = list(pull.queues)
    start = random.randrange(len(queues)) if queues else 0
    for q in queues[start:] + queues[:start]:
        stored = queue_subject(pull.subject, q)
        if not core.state.leases.held_by(stored, pull.key, pull.consumer, now):
            continue
        retry = retry_subject(stored, pull.key)
        yield retry, retry
        yield retry, stored


def not_held(core: BrokerCore, pull: PullRequest) -> list[int]:
    """The queues an ordered pull named whose lease its consumer does not hold."""
    if pull.queues is None:
        return []
    now = core.clock()
    leases = core.state.leases
    return [q for q in pull.queues if not leases.held_by(queue_subject(pull.subject, q), pull.key, pull.consumer, now)]


class Ordering:
    """BROKER_QUEUE_LOCK: {"subject", "group", "consumer", "queues": [q], "release": [q], "leave"}
    -> {"held": [q], "granted": [q], "stopped": [[q, [order keys]]], "holders": [[q, consumer]],
    "members": [consumer], "lease_s"}."""

    def __init__(self, core: BrokerCore) -> None:
        self.core = core

    async def lock(self, body: dict[str, Any]) -> dict[str, Any]:
        core = self.core
        subject = validate_subject(field(body, "subject", str), limits=core.limits)
        key = validate_group(body.get("group"))
        consumer = validate_consumer(body.get("consumer"))
        wanted = ordered_queues(body) or ()
        release = ordered_queues(body, "release") or ()
        leave = bool(body.get("leave", False))
        leases = core.state.leases
        now = core.clock()
        if leave:
            leases.left(subject, key, consumer)
        else:
            leases.seen(subject, key, consumer, now)
        entries: list[Entry] = []
        for q in release:
            stored = queue_subject(subject, q)
            if leases.held_by(stored, key, consumer, now):
                entries.append(Leased(stored, key, ""))
        held: list[int] = []
        granted: list[int] = []
        for q in wanted:
            if q in release:
                continue
            stored = queue_subject(subject, q)
            holder = leases.holder(stored, key, now)
            if holder == consumer:
                leases.renew(stored, key, now)
                held.append(q)
            elif holder is None:
                groups = [
                    g for s in (stored, retry_subject(stored, key)) if (g := core.state.group(s, key)) is not None
                ]
                for group, action in handover(groups):
                    entries.append(GroupAction(group.subject, key, action))
                entries.append(Leased(stored, key, consumer))
                held.append(q)
                granted.append(q)
        if entries:
            end = core.apply_and_commit(entries)
            await core.store.durable(end)
        holders = []
        for q in range(ORDERED_QUEUES):
            holder = leases.holder(queue_subject(subject, q), key, now)
            if holder is not None:
                holders.append([q, holder])
        stopped = [[q, sorted(keys)] for q in held if (keys := leases.stopped_keys(queue_subject(subject, q), key))]
        return {
            "stopped": stopped,
            "held": held,
            "granted": granted,
            "holders": holders,
            "members": leases.members(subject, key, now),
            "lease_s": leases.lease_s,
        }
