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
from qmq.outbox.info_tx import NOTIFIED, PENDING, InfoTransaction


class SessionTransaction(InfoTransaction):
    """`OutboxTransaction` over a `Session` in a transaction."""

    def __init__(self, handoff: Handoff, session: Session) -> None:
        super().__init__(handoff, session, session.get_bind().dialect.name)
        self.session = session

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        connection = self.session.connection()  # begins the session's transaction if need be
        rows.insert_on_connection(connection, values, lease_token, lease_s)


def _after_commit(session: Session) -> None:
    if session.in_nested_transaction():
        return  # a savepoint was released: the outer transaction may still roll back
    if not session.info:
        return
    waiting = session.info.pop(PENDING, None)
    session.info.pop(NOTIFIED, None)
    if not waiting:
        return
    hand_over(waiting)


def _after_transaction_end(session: Session, transaction: Any) -> None:
    if transaction.parent is None and session.info:  # the outermost transaction ended (after a commit: gone already)
        session.info.pop(PENDING, None)
        session.info.pop(NOTIFIED, None)


# On every Session (and subclass) once, rather than per session: listening is costly, and these return
# at once for a session that sent nothing.
sa.event.listen(Session, "after_commit", _after_commit)
sa.event.listen(Session, "after_transaction_end", _after_transaction_end)
