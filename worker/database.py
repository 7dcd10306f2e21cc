"""Where a consumer's transaction runs, around its handler and its idempotency record: the app's
SQLAlchemy engine (`App(db=URL)` or `engine=`), or a Django database alias (`App(using=alias)`,
qmq/contrib/django/consumer.py). The transaction step (worker/steps/transaction.py) opens one per
message; a handler's work and its idempotency record commit together or not at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.orm import Session

from worker.schema import consumed


class HandlerTransaction(Protocol):
    """One message's open transaction, as the steps inside the transaction step see it."""

    connection: sa.Connection | None  # SQLAlchemy: the connection in the transaction
    session: Session | None  # SQLAlchemy, for handlers that take `session`: bound to `connection`

    def cursor(self) -> contextlib.AbstractContextManager[Any]:
        """A DB-API cursor in the transaction, taking `%s` placeholders."""

    def rollback_only(self) -> None:
        """End the transaction with a rollback instead of a commit (a step chose a retry)."""


class ConsumerDatabase(Protocol):
    def transaction(self, with_session: bool) -> contextlib.AbstractContextManager[HandlerTransaction]:
        """A transaction for one message: committed when the block ends (unless `rollback_only`),
        rolled back if it raises."""

    def engine(self) -> sa.Engine:
        """An engine on the same database, for the worker's own chores (the purge, the table check)."""


class SQLAlchemyTransaction:
    def __init__(self, connection: sa.Connection, session: Session | None) -> None:
        self.connection = connection
        self.session = session
        self.rolled_back = False

    @contextlib.contextmanager
    def cursor(self) -> Iterator[Any]:
        cursor = self.connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            yield cursor
        finally:
            cursor.close()

    def rollback_only(self) -> None:
        self.rolled_back = True


class SQLAlchemyDatabase:
    """The handler's Session is bound to the transaction's connection (SQLAlchemy's "join an external
    transaction" recipe): its writes are flushed and committed with the idempotency record. It is
    made only for handlers that ask for it; a handler must not commit it itself."""

    def __init__(self, engine: Callable[[], sa.Engine]) -> None:
        self._engine = engine

    def engine(self) -> sa.Engine:
        return self._engine()

    @contextlib.contextmanager
    def transaction(self, with_session: bool) -> Iterator[HandlerTransaction]:
        with self._engine().connect() as connection:
            transaction = connection.begin()
            session = Session(bind=connection, expire_on_commit=False) if with_session else None
            handler_transaction = SQLAlchemyTransaction(connection, session)
            try:
                yield handler_transaction
                if session is not None:
                    session.flush()
            except BaseException:
                transaction.rollback()
                raise
            finally:
                if session is not None:
                    session.close()
            if handler_transaction.rolled_back:
                transaction.rollback()
            else:
                transaction.commit()


class MissingTables(Exception):
    """The database lacks a table the app's consumers need; the message says how to create it."""


def check_tables(database: ConsumerDatabase, needs_consumed: bool) -> None:
    """Raise MissingTables when idempotent consumers have no `qmq_consumed` table to record in.
    Database errors (unreachable) propagate for the caller to wait and try again."""
    if not needs_consumed:
        return
    engine = database.engine()
    if sa.inspect(engine).has_table(consumed.name):
        return
    shown = engine.url.render_as_string(hide_password=True)
    raise MissingTables(
        f"the table {consumed.name} does not exist in {shown}: idempotent consumers record each message "
        f"they handled there. Create it with `qmq db upgrade --db {shown}`, or, for a Django app, with "
        '`python manage.py migrate` ("qmq.contrib.django" in INSTALLED_APPS)'
    )
