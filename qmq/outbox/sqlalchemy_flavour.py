"""The SQLAlchemy flavour (`Producer(engine=...)` or `session=`, Flask-SQLAlchemy's `db.session`
included): messages are written through the caller's own Session or Connection, and
`@qmq.transactional` runs a function in one transaction.

Which transaction `send` joins: the one named (`session=s`, `connection=conn`), else the enclosing
`@qmq.transactional` block, else the Producer's scoped session (`db.session`: the current request's
session, begun if need be); otherwise none, and `send` refuses (NotInTransaction).

The decorated function gets the Session as its `session` argument when it has one. It joins, with a
savepoint, a transaction the caller has open on the producer's database: a Session given to it, an
enclosing `@transactional`, a Session the caller began (`with session.begin():`) or a Connection in
a transaction (`with engine.begin() as conn:`) on this thread; its messages ship when that outer
transaction commits. Otherwise it commits its own work (with anything its session had auto-begun
before) when it returns. An exception rolls back the function's work and its messages, and propagates.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, SessionTransactionOrigin, scoped_session

from qmq.db.url import same_database
from qmq.outbox import context, open_transactions
from qmq.outbox.connection_tx import ConnectionTransaction, watch
from qmq.outbox.flavour import Handoff, OutboxTransaction
from qmq.outbox.session_tx import SessionTransaction

Savepointed = SessionTransaction | ConnectionTransaction


class SQLAlchemyFlavour:
    """`Flavour` over a SQLAlchemy `engine` and/or `session` (a Session, a factory, or a scoped
    session such as `db.session`)."""

    def __init__(self, engine: sa.Engine | None, session: Any) -> None:
        self._engine: sa.Engine | None = None
        self.session = session
        self._database_name: str | None = None
        if engine is not None:
            self.learn_engine(engine)

    # ---- which transaction `send` writes into ------------------------------------------------------

    def caller_transaction(self, handoff: Handoff) -> OutboxTransaction | None:
        if isinstance(self.session, scoped_session):
            return self.session_transaction(handoff, self.session())
        if isinstance(self.session, Session):
            return self.session_transaction(handoff, self.session)
        return None

    def given_transaction(self, handoff: Handoff, session: Any, connection: Any) -> OutboxTransaction:
        if session is not None and connection is not None:
            raise ValueError("give send() session= or connection=, not both")
        if isinstance(session, scoped_session):
            session = session()
        if session is not None and not isinstance(session, Session):
            raise TypeError(f"send(session=...) takes a SQLAlchemy Session, not {type(session).__name__}")
        if connection is not None and not isinstance(connection, sa.Connection):
            raise TypeError(f"send(connection=...) takes a SQLAlchemy Connection, not {type(connection).__name__}")
        if session is not None:
            return self.session_transaction(handoff, session)
        return self.connection_transaction(handoff, connection)

    @contextlib.contextmanager
    def standalone(self, handoff: Handoff) -> Iterator[OutboxTransaction]:
        with self.engine().begin() as connection:  # its messages are handed over as the block ends
            yield ConnectionTransaction(handoff, connection)

    def how_to_join(self) -> str:
        hint = (
            "Pass the transaction you are in: send(..., session=s) for a SQLAlchemy Session, "
            "send(..., connection=conn) for a Connection (`with engine.begin() as conn:`); or run the code "
            "in a function decorated with @qmq.transactional(producer)"
        )
        if self._engine is not None and open_transactions.innermost(self._engine.url) is not None:
            hint = "A transaction on this database is open on this thread, but send() was not told which. " + hint
        return hint

    def session_transaction(self, handoff: Handoff, session: Session) -> Savepointed:
        """An outbox transaction on `session`; its engine becomes the sender's if none was given. A
        session bound to a Connection of the caller's commits nothing itself: the connection does."""
        bind = session.get_bind()
        if isinstance(bind, sa.Connection):
            return self.connection_transaction(handoff, bind)
        self._check_database(bind)
        return SessionTransaction(handoff, session)

    def connection_transaction(self, handoff: Handoff, connection: sa.Connection) -> ConnectionTransaction:
        self._check_database(connection.engine)
        return ConnectionTransaction(handoff, connection)

    def _check_database(self, engine: sa.Engine) -> None:
        self.learn_engine(engine)
        assert self._engine is not None
        if not same_database(engine.url, self._engine.url):
            raise ValueError(
                f"this Producer's outbox is in {self._engine.url.render_as_string()}, but the transaction given "
                f"writes to {engine.url.render_as_string()}: use a Producer per database"
            )

    # ---- the database ------------------------------------------------------------------------------

    def learn_engine(self, engine: sa.Engine) -> None:
        """The engine the application writes through, when the Producer got only `session=`."""
        if self._engine is None:
            self._engine = engine
            watch(engine)

    def engine(self) -> sa.Engine:
        if self._engine is None:
            raise RuntimeError("this Producer has no engine yet: give engine= or send inside @qmq.transactional first")
        return self._engine

    def close(self) -> None:
        """Nothing: the engine is the application's."""

    def database_name(self) -> str:
        if self._database_name is None:
            self._database_name = str(self.engine().url.database or "")
        return self._database_name

    # ---- @qmq.transactional ------------------------------------------------------------------------

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
            if isinstance(given, Session):
                return self._run_in_transaction(producer, given, fn, args, kwargs)
            chosen, owned = self._session_for_call(producer, session)
            if takes_session and given is None:
                kwargs["session"] = chosen
            try:
                return self._run_in_transaction(producer, chosen, fn, args, kwargs)
            finally:
                if owned:
                    chosen.close()

        return wrapper

    def _session_for_call(self, producer: Any, session: Any) -> tuple[Session, bool]:
        """The Session a decorated call runs in, and whether the call owns it (closes it after)."""
        if session is not None:
            return (session if isinstance(session, Session) else session()), False
        if self.session is not None and not _is_plain_factory(self.session):
            return self.default_session(), False
        enclosing = context.current(producer)
        if isinstance(enclosing, SessionTransaction):
            return enclosing.session, False
        caller = open_transactions.innermost(self._engine.url) if self._engine is not None else None
        if isinstance(caller, Session):
            return caller, False
        if isinstance(caller, sa.Connection):  # joined with a savepoint of the caller's connection
            return Session(bind=caller, join_transaction_mode="create_savepoint"), True
        return self.default_session(), self.session is None

    def _run_in_transaction(
        self, producer: Any, session: Session, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        enclosing = context.current(producer)
        transaction = self.session_transaction(producer.handoff, session)
        joined = isinstance(enclosing, SessionTransaction) and enclosing.session is session
        with context.opened(producer, transaction):
            outer = session.get_transaction()
            if isinstance(transaction, ConnectionTransaction) or (
                outer is not None and (joined or outer.origin is not SessionTransactionOrigin.AUTOBEGIN)
            ):
                return _in_savepoint(session, transaction, fn, args, kwargs)
            if outer is None:
                with session.begin():
                    return fn(*args, **kwargs)
            try:  # a transaction the session began by itself: committed with the function's work
                result = fn(*args, **kwargs)
            except BaseException:
                session.rollback()
                raise
            session.commit()
            return result


def _in_savepoint(
    session: Session, transaction: Savepointed, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
) -> Any:
    """`fn` in a savepoint of the transaction `session` is in (a Session on the caller's connection
    makes its own transaction a savepoint); its messages are dropped if it raises."""
    mark = transaction.mark()
    try:
        with session.begin_nested() if session.in_transaction() else session.begin():
            return fn(*args, **kwargs)
    except BaseException:
        transaction.drop_since(mark)
        raise


def _is_plain_factory(session: Any) -> bool:
    """A sessionmaker (or any callable making a new Session each time), as opposed to a Session or a
    scoped session, whose current session is the caller's."""
    return not isinstance(session, Session | scoped_session) and callable(session)
