"""The Django flavour of an outbox transaction: rows are written on the alias's connection inside its
`atomic` block, and handed to the sender by `transaction.on_commit`, which Django discards for a
savepoint that rolls back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db import connections, transaction

from qmq.outbox import rows
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.shipping import Shipment

if TYPE_CHECKING:
    from qmq.outbox.producer import Producer


def in_atomic_block(alias: str) -> bool:
    return connections[alias].in_atomic_block


def atomic(alias: str) -> Any:
    return transaction.atomic(using=alias)


class DjangoTransaction:
    """`OutboxTransaction` over the open `atomic` block of a Django database alias."""

    def __init__(self, producer: Producer, alias: str) -> None:
        self.producer = producer
        self.alias = alias
        self.dialect = connections[alias].vendor

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        params = {**values, "lease_token": lease_token, "lease_s": lease_s} if lease_token else values
        statement = rows.compiled_insert(self.dialect, lease_token is not None, "format")
        with connections[self.alias].cursor() as cursor:
            cursor.execute(statement.sql, statement.parameters(params))

    def notify(self) -> None:
        if self.dialect == "postgresql":
            with connections[self.alias].cursor() as cursor:
                cursor.execute(NOTIFY_SQL.replace("%", "%%"))

    def after_commit(self, shipment: Shipment) -> None:
        transaction.on_commit(lambda: self.producer.handoff([shipment]), using=self.alias)
