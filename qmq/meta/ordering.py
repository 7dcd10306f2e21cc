"""Ordered subjects in the meta server (docs/ordering.md): which broker group holds each logical queue.

The first time a queue of an ordered subject is asked for (`META_ROUTE` of `subject#queue`), the
subject's `ORDERED_QUEUES` queues are given to the groups of its route, queue i to the i-th group
modulo their number, and recorded in `qmq_meta_queue`. From then on the record answers: a group that
joins the route later gets no queue, a group that is down keeps its queues (its messages wait rather
than overtake each other elsewhere), so a key never moves silently. With replicated groups the group
name outlives a failover, and the queue stays with the group. Blocking (SQL): call off the loop.
"""

from __future__ import annotations

import sqlalchemy as sa

from qmq.meta import schema
from qmq.meta.registry import Registry, Route
from qmq.protocol.ordering import ORDERED_QUEUES, split_queue_subject


def assignment(registry: Registry, subject: str) -> list[str]:
    """The broker group of each queue of `subject` (index = queue), made now if there is none yet;
    empty while the subject has no route (no broker group registered)."""
    names = _read(registry, subject)
    if names:
        return names
    route = registry.route(subject, create=True)
    groups = [g.name for g in route.groups]
    if not groups:
        return []
    now = registry.clock()
    try:
        with registry.engine.begin() as conn:
            conn.execute(
                schema.queue.insert(),
                [
                    {"subject": subject, "queue": q, "group_name": groups[q % len(groups)], "created_at": now}
                    for q in range(ORDERED_QUEUES)
                ],
            )
    except sa.exc.IntegrityError:  # another meta server recorded it first: its answer stands
        pass
    return _read(registry, subject)


def queue_route(registry: Registry, stored: str) -> Route:
    """The route of one queue, `subject#queue`: the one group holding it (none while there is none)."""
    split = split_queue_subject(stored)
    if split is None:
        raise ValueError(f"{stored!r} is not a queue of an ordered subject")
    subject, queue = split
    names = assignment(registry, subject)
    if not names:
        return Route(stored, (), ())
    groups = {g.name: g for g in registry.groups()}
    group = groups.get(names[queue])
    return Route(stored, (group,) if group is not None else (), ())


def _read(registry: Registry, subject: str) -> list[str]:
    with registry.engine.connect() as conn:
        rows = conn.execute(
            sa.select(schema.queue.c.queue, schema.queue.c.group_name)
            .where(schema.queue.c.subject == subject)
            .order_by(schema.queue.c.queue)
        ).all()
    return [row.group_name for row in rows]
