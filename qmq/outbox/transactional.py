"""`@qmq.transactional(producer)`: run a function as one database transaction in which
`producer.send` writes its outbox rows; the messages ship after the commit and vanish on a rollback.

How the transaction is opened is the producer's flavour's business: SQLAlchemy sessions
(qmq/outbox/sqlalchemy_flavour.py) or Django's `atomic` (qmq/contrib/django/flavour.py). An
exception rolls back the function's work and its messages, and propagates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from qmq.outbox.producer import Producer

F = TypeVar("F", bound=Callable[..., Any])


def transactional(producer: Producer, *, session: Any = None) -> Callable[[F], F]:
    """Decorate a function so that it runs as one transaction of `producer`'s database. `session`
    overrides the producer's default session (a Session, a factory, or `db.session`; SQLAlchemy only)."""
    if not isinstance(producer, Producer):
        raise TypeError(f"@qmq.transactional needs a qmq.Producer, not {type(producer).__name__}")

    def decorate(fn: F) -> F:
        return producer.flavour.decorate(producer, fn, session)  # type: ignore[return-value]

    return decorate
