"""The SQLAlchemy flavour of an outbox transaction: rows go through the application's own `Session`
(plain SQLAlchemy 2, or Flask-SQLAlchemy's `db.session`), so they commit or roll back with its rows.

The messages of a session wait in `session.info` until its outermost transaction commits, then go to
their producer's sender (its `handoff`); a rollback drops them. Savepoints need no bookkeeping for
correctness: the sender ships only rows it finds in the database, and a rolled-back savepoint's rows
are not there.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from qmq.outbox import rows
from qmq.outbox.flavour import Handoff, hand_over
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.shipping import Shipment

_PENDING = "qmq.outbox.pending"  # session.info key: [(handoff, shipment)] awaiting the commit
_NOTIFIED = "qmq.outbox.notified"  # session.info key: NOTIFY already queued in this transaction


class SessionTransaction:
    """`OutboxTransaction` over a `Session` in a transaction."""

    def __init__(self, handoff: Handoff, session: Session) -> None:
        self.handoff = handoff
        self.session = session
        self.dialect = session.get_bind().dialect.name

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        connection = self.session.connection()  # begins the session's transaction if need be
        rows.insert_on_connection(connection, values, lease_token, lease_s)

    def notify(self) -> None:
        if self.dialect == "postgresql" and not self.session.info.get(_NOTIFIED):
            self.session.execute(sa.text(NOTIFY_SQL))
            self.session.info[_NOTIFIED] = True

    def after_commit(self, shipment: Shipment) -> None:
        self.session.info.setdefault(_PENDING, []).append((self.handoff, shipment))

    def mark(self) -> int:
        """A position in the waiting messages, to `drop_since` when a savepoint rolls back."""
        return len(self.session.info.get(_PENDING, ()))

    def drop_since(self, mark: int) -> None:
        del self.session.info.get(_PENDING, [])[mark:]


def _after_commit(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a savepoint was released: the outer transaction may still roll back
    if not session.info:
        return
    waiting = session.info.pop(_PENDING, None)
    session.info.pop(_NOTIFIED, None)
    if not waiting:
        return
    hand_over(waiting)


def _after_transaction_end(session: Session, transaction: Any) -> None:
    if transaction.parent is None and session.info:  # the outermost transaction ended (after a commit: gone already)
        session.info.pop(_PENDING, None)
        session.info.pop(_NOTIFIED, None)


# On every Session (and subclass) once, rather than per session: listening is costly, and these return
# at once for a session that sent nothing.
sa.event.listen(Session, "after_commit", _after_commit)
sa.event.listen(Session, "after_transaction_end", _after_transaction_end)
