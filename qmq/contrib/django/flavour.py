"""The Django flavour (`Producer(using=alias)`): outbox rows are written on the alias's connection
inside its `atomic` block, and handed to the sender by `transaction.on_commit`, which Django discards
for a savepoint that rolls back. `@qmq.transactional(producer)` is a `transaction.atomic(using=alias)`
block (nested blocks are savepoints); `send` inside any `atomic` block of the alias joins it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from django.db import connections, transaction

from qmq.contrib.django.engine import engine_for_alias, url_for_alias
from qmq.outbox import context, rows
from qmq.outbox.flavour import Handoff, OutboxTransaction
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.shipping import Shipment


class DjangoTransaction:
    """`OutboxTransaction` over the open `atomic` block of a Django database alias."""

    def __init__(self, handoff: Handoff, alias: str) -> None:
        self.handoff = handoff
        self.alias = alias
        self.dialect = connections[alias].vendor

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        with connections[self.alias].cursor() as cursor:
            rows.insert_with_cursor(cursor, self.dialect, "format", values, lease_token, lease_s)

    def notify(self) -> None:
        if self.dialect == "postgresql":
            with connections[self.alias].cursor() as cursor:
                cursor.execute(NOTIFY_SQL.replace("%", "%%"))

    def after_commit(self, shipment: Shipment) -> None:
        transaction.on_commit(lambda: self.handoff([shipment]), using=self.alias)


class DjangoFlavour:
    """`Flavour` over one Django database alias."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self._engine: sa.Engine | None = None

    def caller_transaction(self, handoff: Handoff) -> OutboxTransaction | None:
        return DjangoTransaction(handoff, self.alias) if connections[self.alias].in_atomic_block else None

    def given_transaction(self, handoff: Handoff, session: Any, connection: Any) -> OutboxTransaction:
        raise TypeError(
            "send(session=...) and send(connection=...) are for SQLAlchemy producers; a Django producer "
            f"joins the transaction.atomic block of its alias ({self.alias!r})"
        )

    def how_to_join(self) -> str:
        return (
            f"Run it inside transaction.atomic(using={self.alias!r}) (or a function decorated with "
            "@qmq.transactional(producer), or a view under ATOMIC_REQUESTS)"
        )

    @contextlib.contextmanager
    def standalone(self, handoff: Handoff) -> Iterator[OutboxTransaction]:
        with transaction.atomic(using=self.alias):
            yield DjangoTransaction(handoff, self.alias)

    def decorate(self, producer: Any, fn: Callable[..., Any], session: Any) -> Callable[..., Any]:
        if session is not None:
            raise TypeError("@qmq.transactional(session=...) is for SQLAlchemy; a Django producer uses its alias")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with (
                transaction.atomic(using=self.alias),
                context.opened(producer, DjangoTransaction(producer.handoff, self.alias)),
            ):
                return fn(*args, **kwargs)

        return wrapper

    def engine(self) -> sa.Engine:
        if self._engine is None:
            self._engine = engine_for_alias(self.alias)
        return self._engine

    def close(self) -> None:
        """Close the connections of the engine made for the sender (`engine_for_alias`)."""
        if self._engine is not None:
            self._engine.dispose()

    def database_name(self) -> str:
        return str(url_for_alias(self.alias).database or "")
