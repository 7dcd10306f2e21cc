"""The SQLAlchemy flavour of an outbox transaction: rows go through the application's own `Session`
(plain SQLAlchemy 2, or Flask-SQLAlchemy's `db.session`), so they commit or roll back with its rows.

The messages of a session wait in `session.info` until its outermost transaction commits, then go to
their producer's sender; a rollback drops them. Savepoints need no bookkeeping for correctness: the
sender ships only rows it finds in the database, and a rolled-back savepoint's rows are not there.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from qmq.outbox import rows
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.shipping import Shipment

if TYPE_CHECKING:
    from qmq.outbox.producer import Producer

_PENDING = "qmq.outbox.pending"  # session.info key: [(producer, shipment)] awaiting the commit
_NOTIFIED = "qmq.outbox.notified"  # session.info key: NOTIFY already queued in this transaction
_HOOKED = "qmq.outbox.hooked"  # session.info key: our event listeners are on this session


class SessionTransaction:
    """`OutboxTransaction` over a `Session` in a transaction."""

    def __init__(self, producer: Producer, session: Session) -> None:
        self.producer = producer
        self.session = session
        bind = session.get_bind()
        self.dialect = bind.dialect.name
        producer.learn_engine(bind.engine if isinstance(bind, sa.Connection) else bind)
        _hook(session)

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        self.session.execute(rows.insert(self.dialect, lease_token, lease_s), values)

    def notify(self) -> None:
        if self.dialect == "postgresql" and not self.session.info.get(_NOTIFIED):
            self.session.execute(sa.text(NOTIFY_SQL))
            self.session.info[_NOTIFIED] = True

    def after_commit(self, shipment: Shipment) -> None:
        self.session.info.setdefault(_PENDING, []).append((self.producer, shipment))

    def mark(self) -> int:
        """A position in the waiting messages, to `drop_since` when a savepoint rolls back."""
        return len(self.session.info.get(_PENDING, ()))

    def drop_since(self, mark: int) -> None:
        del self.session.info.get(_PENDING, [])[mark:]


def _hook(session: Session) -> None:
    if session.info.get(_HOOKED):
        return
    sa.event.listen(session, "after_commit", _after_commit)
    sa.event.listen(session, "after_transaction_end", _after_transaction_end)
    session.info[_HOOKED] = True


def _after_commit(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a savepoint was released: the outer transaction may still roll back
    waiting = session.info.pop(_PENDING, None)
    session.info.pop(_NOTIFIED, None)
    if not waiting:
        return
    by_producer: dict[Producer, list[Shipment]] = defaultdict(list)
    for producer, shipment in waiting:
        by_producer[producer].append(shipment)
    for producer, shipments in by_producer.items():
        producer.handoff(shipments)


def _after_transaction_end(session: Session, transaction: Any) -> None:
    if transaction.parent is None:  # the outermost transaction ended; after a commit these are gone already
        session.info.pop(_PENDING, None)
        session.info.pop(_NOTIFIED, None)
