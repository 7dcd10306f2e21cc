"""An outbox transaction over a SQLAlchemy `Connection` (Core, or a Session bound to a connection the
caller holds): rows go through the connection's own transaction, and its messages go to the sender
once that transaction has committed.

SQLAlchemy has no "after commit" event for a Connection, so the messages wait in `connection.info`
(which belongs to the DB-API connection): the `commit` event (sent just before the COMMIT) marks them
committed, and they are handed over when the connection begins its next transaction or goes back to
the pool, whichever comes first (`with engine.begin() as conn:` hands them over as the block ends).
A `rollback` drops them. Correctness never rests on this timing: the sender ships only rows it finds
in the database, so a message handed over too early (its COMMIT failed) is simply not there; one
never handed over (a connection kept idle after its commit) is shipped by the relay when its lease
runs out.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from qmq.outbox import open_transactions, rows
from qmq.outbox.flavour import Handoff, hand_over
from qmq.outbox.info_tx import NOTIFIED, PENDING, InfoTransaction

_COMMITTED = "qmq.outbox.committed"  # connection.info: the same, committed, not yet handed over


class ConnectionTransaction(InfoTransaction):
    """`OutboxTransaction` over a `Connection` in a transaction."""

    def __init__(self, handoff: Handoff, connection: sa.Connection) -> None:
        watch(connection.engine)
        super().__init__(handoff, connection, connection.dialect.name)
        self.connection = connection

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        rows.insert_on_connection(self.connection, values, lease_token, lease_s)


def watch(engine: sa.Engine) -> None:
    """Follow the transactions of `engine`'s connections (once per engine): for the messages above,
    and for `@qmq.transactional` to find a transaction the caller has open (open_transactions.py)."""
    if sa.event.contains(engine, "commit", _committing):
        return
    sa.event.listen(engine, "begin", _began)
    sa.event.listen(engine, "commit", _committing)
    sa.event.listen(engine, "rollback", _rolled_back)
    sa.event.listen(engine, "checkin", _checked_in)


def _info(connection: sa.Connection) -> dict:
    """The connection's `info`; empty once the connection was invalidated (the database went away):
    what waited there went with its DB-API connection, and asking for it would raise (inside the
    application's rollback, hiding the error that caused it) or reconnect."""
    return {} if connection.invalidated else connection.info


def _began(connection: sa.Connection) -> None:
    _hand_over(_info(connection))
    open_transactions.push(connection)


def _committing(connection: sa.Connection) -> None:
    info = _info(connection)
    info.pop(NOTIFIED, None)
    waiting = info.pop(PENDING, None)
    if waiting:
        info.setdefault(_COMMITTED, []).extend(waiting)
    open_transactions.remove(connection)


def _rolled_back(connection: sa.Connection) -> None:
    info = _info(connection)
    info.pop(PENDING, None)
    info.pop(NOTIFIED, None)
    open_transactions.remove(connection)


def _checked_in(dbapi_connection: Any, record: Any) -> None:
    _hand_over(record.info)


def _hand_over(info: dict) -> None:
    committed = info.pop(_COMMITTED, None)
    if not committed:
        return
    hand_over(committed)
