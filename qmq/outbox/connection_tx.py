"""An outbox transaction over a SQLAlchemy `Connection` (Core, no Session): rows go through the
connection's own transaction, and its messages wait in `pending` until whoever commits it hands them
to the sender."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from qmq.outbox import rows
from qmq.outbox.flavour import Handoff
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.shipping import Shipment


class ConnectionTransaction:
    """`OutboxTransaction` over a `Connection` in a transaction."""

    def __init__(self, handoff: Handoff, connection: sa.Connection) -> None:
        self.handoff = handoff
        self.connection = connection
        self.dialect = connection.dialect.name
        self.pending: list[Shipment] = []
        self._notified = False

    def insert(self, values: dict[str, Any], lease_token: str | None, lease_s: float) -> None:
        rows.insert_on_connection(self.connection, values, lease_token, lease_s)

    def notify(self) -> None:
        if self.dialect == "postgresql" and not self._notified:
            self.connection.execute(sa.text(NOTIFY_SQL))
            self._notified = True

    def after_commit(self, shipment: Shipment) -> None:
        self.pending.append(shipment)
