"""The SQLAlchemy flavour (`Producer(engine=...)` or `session=`, Flask-SQLAlchemy's `db.session`
included): messages are written through the application's own Session, and `@qmq.transactional`
runs a function in one.

The decorated function gets the Session as its `session` argument when it has one. A session that
the caller already began (`with session.begin():`) or an enclosing `@transactional` is joined with a
savepoint, and the messages ship when that outer transaction commits; otherwise the function's work
(with anything the session had auto-begun before) is committed when it returns. An exception rolls
back the function's work and its messages, and propagates.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, SessionTransactionOrigin, scoped_session

from qmq.outbox import context
from qmq.outbox.connection_tx import ConnectionTransaction
from qmq.outbox.flavour import Handoff, OutboxTransaction
from qmq.outbox.session_tx import SessionTransaction


class SQLAlchemyFlavour:
    """`Flavour` over a SQLAlchemy `engine` and/or `session` (a Session, a factory, or a scoped
    session such as `db.session`)."""

    def __init__(self, engine: sa.Engine | None, session: Any) -> None:
        self._engine = engine
        self.session = session
        self._database_name: str | None = None

    def caller_transaction(self, handoff: Handoff) -> OutboxTransaction | None:
        return None

    @contextlib.contextmanager
    def standalone(self, handoff: Handoff) -> Iterator[OutboxTransaction]:
        with self.engine().begin() as connection:
            transaction = ConnectionTransaction(handoff, connection)
            yield transaction
        if transaction.pending:
            handoff(transaction.pending)

    def session_transaction(self, handoff: Handoff, session: Session) -> SessionTransaction:
        """An outbox transaction on `session`; its engine becomes the sender's if none was given."""
        bind = session.get_bind()
        self.learn_engine(bind.engine if isinstance(bind, sa.Connection) else bind)
        return SessionTransaction(handoff, session)

    def learn_engine(self, engine: sa.Engine) -> None:
        """The engine the application's sessions write through, when the Producer got only `session=`."""
        if self._engine is None:
            self._engine = engine

    def engine(self) -> sa.Engine:
        if self._engine is None:
            raise RuntimeError("this Producer has no engine yet: give engine= or send inside @qmq.transactional first")
        return self._engine

    def database_name(self) -> str:
        if self._database_name is None:
            self._database_name = str(self.engine().url.database or "")
        return self._database_name

    def default_session(self) -> Session:
        """A Session for `@qmq.transactional` when the function is not given one: the Producer's
        `session` (called if it is a factory or Flask-SQLAlchemy's scoped session), else a new one."""
        if isinstance(self.session, Session):
            return self.session
        if isinstance(self.session, scoped_session) or callable(self.session):
            return self.session()
        if self._engine is None:
            raise RuntimeError("@qmq.transactional needs a session: give the Producer engine= or session=")
        return Session(self._engine)

    def decorate(self, producer: Any, fn: Callable[..., Any], session: Any) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        takes_session = "session" in signature.parameters

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = signature.bind_partial(*args, **kwargs).arguments.get("session") if takes_session else None
            chosen = given if isinstance(given, Session) else self._session(session)
            if takes_session and given is None:
                kwargs["session"] = chosen
            owned = given is None and session is None and self.session is None
            try:
                return self._run_in_transaction(producer, chosen, fn, args, kwargs)
            finally:
                if owned:
                    chosen.close()

        return wrapper

    def _session(self, session: Any) -> Session:
        if session is None:
            return self.default_session()
        return session if isinstance(session, Session) else session()

    def _run_in_transaction(
        self, producer: Any, session: Session, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        enclosing = context.current(producer)
        joined = isinstance(enclosing, SessionTransaction) and enclosing.session is session
        transaction = self.session_transaction(producer.handoff, session)
        with context.opened(producer, transaction):
            outer = session.get_transaction()
            if outer is not None and (joined or outer.origin is not SessionTransactionOrigin.AUTOBEGIN):
                mark = transaction.mark()
                try:
                    with session.begin_nested():
                        return fn(*args, **kwargs)
                except BaseException:
                    transaction.drop_since(mark)
                    raise
            if outer is None:
                with session.begin():
                    return fn(*args, **kwargs)
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                session.rollback()
                raise
            session.commit()
            return result
