"""`@qmq.transactional(producer)`: run a function as one database transaction in which
`producer.send` writes its outbox rows; the messages ship after the commit and vanish on a rollback.

Flavours, chosen by the producer:
- SQLAlchemy (`Producer(engine=...)` or `session=`, Flask-SQLAlchemy's `db.session` included): the
  function gets the Session as its `session` argument when it has one. A session that the caller
  already began (`with session.begin():`) or an enclosing `@transactional` is joined with a savepoint,
  and the messages ship when that outer transaction commits; otherwise the function's work (with
  anything the session had auto-begun before) is committed when it returns.
- Django (`Producer(using="alias")`): `transaction.atomic(using=alias)`, nested blocks as savepoints.

An exception rolls back the function's work and its messages, and propagates.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session, SessionTransactionOrigin

from qmq.outbox import context
from qmq.outbox.producer import Producer
from qmq.outbox.session_tx import SessionTransaction

F = TypeVar("F", bound=Callable[..., Any])


def transactional(producer: Producer, *, session: Any = None) -> Callable[[F], F]:
    """Decorate a function so that it runs as one transaction of `producer`'s database. `session`
    overrides the producer's default session (a Session, a factory, or `db.session`)."""
    if not isinstance(producer, Producer):
        raise TypeError(f"@qmq.transactional needs a qmq.Producer, not {type(producer).__name__}")

    def decorate(fn: F) -> F:
        if producer.using is not None:
            return _django(producer, fn)
        return _sqlalchemy(producer, fn, session)

    return decorate


def _sqlalchemy(producer: Producer, fn: F, default_session: Any) -> F:
    signature = inspect.signature(fn)
    takes_session = "session" in signature.parameters

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(*args, **kwargs).arguments.get("session") if takes_session else None
        session = given if isinstance(given, Session) else _session(producer, default_session)
        if takes_session and given is None:
            kwargs["session"] = session
        owned = given is None and default_session is None and producer.session is None
        try:
            return _run_in_transaction(producer, session, fn, args, kwargs)
        finally:
            if owned:
                session.close()

    return wrapper  # type: ignore[return-value]


def _session(producer: Producer, default_session: Any) -> Session:
    if default_session is None:
        return producer.default_session()
    return default_session if isinstance(default_session, Session) else default_session()


def _run_in_transaction(
    producer: Producer, session: Session, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
) -> Any:
    enclosing = context.current(producer)
    joined = isinstance(enclosing, SessionTransaction) and enclosing.session is session
    transaction = SessionTransaction(producer, session)
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


def _django(producer: Producer, fn: F) -> F:
    from qmq.contrib.django.tx import DjangoTransaction, atomic

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with atomic(producer.using), context.opened(producer, DjangoTransaction(producer, producer.using)):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
