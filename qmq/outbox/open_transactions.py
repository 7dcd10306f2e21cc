"""The SQLAlchemy transactions the application has open on this thread (or asyncio task), so that
`@qmq.transactional` can join the caller's transaction instead of committing apart from it: sessions
whose transaction the caller began (`with session.begin():`), and Core connections in a transaction
on engines a producer watches (qmq/outbox/connection_tx.py).

A session that began by itself (autobegin after a query) is not the caller's transaction in this
sense: the decorated function then runs in a transaction of its own, as documented.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, SessionTransactionOrigin

from qmq.db.url import same_database

_open: ContextVar[tuple[weakref.ref, ...]] = ContextVar("qmq_open_transactions", default=())


def push(holder: Session | sa.Connection) -> None:
    _open.set((*_open.get(), weakref.ref(holder)))


def remove(holder: Session | sa.Connection) -> None:
    entries = _open.get()
    if entries:
        _open.set(tuple(ref for ref in entries if ref() not in (holder, None)))


def innermost(url: sa.URL) -> Session | sa.Connection | None:
    """The innermost transaction open on this thread on the database at `url`: a Session the caller
    began, or a Connection in a transaction; None when there is none."""
    for ref in reversed(_open.get()):
        holder = ref()
        if isinstance(holder, Session):
            transaction = holder.get_transaction()
            if transaction is None or transaction.origin is not SessionTransactionOrigin.BEGIN:
                continue
            try:
                bind = holder.get_bind()
            except sa.exc.UnboundExecutionError:
                continue
        elif isinstance(holder, sa.Connection):
            if holder.closed or not holder.in_transaction():
                continue
            bind = holder
        else:
            continue
        if same_database(bind.engine.url, url):
            return holder
    return None


def _session_began(session: Session, transaction: Any) -> None:
    if transaction.parent is None and transaction.origin is SessionTransactionOrigin.BEGIN:
        push(session)


def _session_ended(session: Session, transaction: Any) -> None:
    if transaction.parent is None:
        remove(session)


def _session_connected(session: Session, transaction: Any, connection: sa.Connection) -> None:
    if not isinstance(session.bind, sa.Connection):  # the session's own connection: the session stands for it
        remove(connection)


sa.event.listen(Session, "after_transaction_create", _session_began)
sa.event.listen(Session, "after_transaction_end", _session_ended)
sa.event.listen(Session, "after_begin", _session_connected)
