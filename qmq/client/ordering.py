"""Ordered consumption on the client side (docs/ordering.md): asking every broker group of a subject
for queue leases, as a loop of steps (BROKER_QUEUE_LOCK), and the even share of queues a consumer
should hold, without I/O.

The share is RocketMQ's "averagely": queues 0..Q-1 in order, consumers sorted, each consumer a
contiguous block, the first `Q mod n` consumers one queue more. Every consumer computes it from the
same member list (the brokers' answer), so they agree without talking to each other; while they do
not yet agree (a member just joined or left), a queue's lease decides: nobody takes a queue whose
lease another holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qmq.client.steps import Call, Calls, Steps
from qmq.protocol.codes import RequestCode
from qmq.protocol.ordering import ORDERED_QUEUES

if TYPE_CHECKING:
    from qmq.client.core import ClientCore

LOCK_TIMEOUT_S = 5.0  # wait for one BROKER_QUEUE_LOCK reply


def share(members: Sequence[str], consumer: str, queues: int = ORDERED_QUEUES) -> list[int]:
    """The queues `consumer` should hold among `members` (it counts as one even when not listed)."""
    everyone = sorted(set(members) | {consumer})
    n, index = len(everyone), everyone.index(consumer)
    size, extra = divmod(queues, n)
    start = index * size + min(index, extra)
    return list(range(start, start + size + (1 if index < extra else 0)))


@dataclass
class QueueLocks:
    """What the brokers answered: the queues held by the asker on every broker that answered, those
    granted anew on at least one (not renewals: what was handed out before on them was taken back),
    the other holders by queue, the group's members, the keys of held queues stopped at a poison
    message, and the brokers that did not answer."""

    held: set[int] = field(default_factory=set)
    granted: set[int] = field(default_factory=set)
    others: dict[int, str] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    stopped: dict[int, set[str]] = field(default_factory=dict)  # queue -> keys stopped at a poison message
    lease_s: float = 0.0
    unanswered: list[str] = field(default_factory=list)


def lock_queues(
    client: ClientCore,
    subject: str,
    group: str,
    consumer: str,
    wanted: Iterable[int],
    release: Iterable[int] = (),
    *,
    leave: bool = False,
) -> Steps[QueueLocks]:
    """Ask every broker group of the ordered `subject` for the leases of queues `wanted` (renewing
    those held) and give back `release`; `leave` says this consumer is going away. Brokers that fail
    are named in `unanswered` and count for nothing, and the route is asked for again next time (a
    failover moved a group's master: a worker that held no queue pulled nothing that would have told
    it, and kept asking the old address until the route expired). `ClientCore.lock_queues` is this
    loop."""
    route = yield from client._routes.lookup(subject)
    body = {
        "subject": subject,
        "group": group,
        "consumer": consumer,
        "queues": sorted(set(wanted)),
        "release": sorted(set(release)),
        "leave": leave,
    }
    groups = [g for g in route.groups if g.addresses]
    replies = yield Calls([Call(g.addresses[0], RequestCode.BROKER_QUEUE_LOCK, body, LOCK_TIMEOUT_S) for g in groups])
    locks = QueueLocks()
    answered = 0
    members: set[str] = set()
    held: set[int] | None = None
    for g, reply in zip(groups, replies, strict=True):
        if isinstance(reply, BaseException):
            locks.unanswered.append(g.name)
            continue
        answered += 1
        got = {int(q) for q in reply.get("held") or ()}
        held = got if held is None else held & got
        members.update(str(m) for m in reply.get("members") or ())
        for q, holder in reply.get("holders") or ():
            if holder != consumer:
                locks.others[int(q)] = str(holder)
        locks.granted |= {int(q) for q in reply.get("granted") or ()}
        for q, keys in reply.get("stopped") or ():
            locks.stopped.setdefault(int(q), set()).update(str(k) for k in keys)
        locks.lease_s = max(locks.lease_s, float(reply.get("lease_s") or 0.0))
    if locks.unanswered:
        client._routes.invalidate([subject])
    locks.held = held or set()
    locks.members = sorted(members)
    return locks
