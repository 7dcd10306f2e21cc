"""Which transaction `producer.send` writes into: the innermost `@transactional` block of that producer
on this thread (or asyncio task), kept in a context variable.

A transaction is any object with the `OutboxTransaction` methods; each framework flavour (SQLAlchemy
sessions in qmq/outbox/session_tx.py, Django in qmq/contrib/django/tx.py) provides one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Protocol

from qmq.outbox.shipping import Shipment


class OutboxTransaction(Protocol):
    """What the producer needs of the application's open transaction."""

    dialect: str  # "postgresql" or "sqlite"

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        """INSERT one outbox row in the transaction, leased to `lease_token` for `lease_s` if given."""

    def notify(self) -> None:
        """Wake the relays when the transaction commits (PostgreSQL NOTIFY; nothing elsewhere)."""

    def after_commit(self, shipment: Shipment) -> None:
        """Hand `shipment` to the producer's sender once the transaction commits; drop it if the
        transaction (or the savepoint it was sent in) rolls back."""


_open: ContextVar[tuple[tuple[object, OutboxTransaction], ...]] = ContextVar("qmq_outbox_transactions", default=())


def current(producer: object) -> OutboxTransaction | None:
    """The innermost open transaction of `producer`, or None."""
    for owner, transaction in reversed(_open.get()):
        if owner is producer:
            return transaction
    return None


@contextlib.contextmanager
def opened(producer: object, transaction: OutboxTransaction) -> Iterator[None]:
    """Make `transaction` the one `producer.send` writes into, for the duration of the block."""
    token = _open.set((*_open.get(), (producer, transaction)))
    try:
        yield
    finally:
        _open.reset(token)
