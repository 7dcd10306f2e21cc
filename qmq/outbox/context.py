"""Which transaction `producer.send` writes into: the innermost `@transactional` block of that producer
on this thread (or asyncio task), kept in a context variable.

A transaction is any object with the `OutboxTransaction` methods (qmq/outbox/flavour.py); each
framework flavour provides one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from qmq.outbox.flavour import OutboxTransaction

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
