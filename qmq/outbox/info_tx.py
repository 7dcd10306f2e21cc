"""What the SQLAlchemy outbox transactions (over a `Session` or a `Connection`) share: the messages of
the open transaction wait in the `info` dict of whatever carries it, with one NOTIFY per transaction
for the relay on PostgreSQL. Savepoints take a `mark` and `drop_since` it when they roll back."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from qmq.outbox.flavour import Handoff
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.shipping import Shipment

PENDING = "qmq.outbox.pending"  # info: [(handoff, shipment)] of the open transaction
NOTIFIED = "qmq.outbox.notified"  # info: NOTIFY already queued in the open transaction


class InfoTransaction:
    """The part of `OutboxTransaction` kept in `carrier.info`; `carrier` executes the NOTIFY."""

    def __init__(self, handoff: Handoff, carrier: Any, dialect: str) -> None:
        self.handoff = handoff
        self.dialect = dialect
        self._carrier = carrier

    def notify(self) -> None:
        if self.dialect == "postgresql" and not self._carrier.info.get(NOTIFIED):
            self._carrier.execute(sa.text(NOTIFY_SQL))
            self._carrier.info[NOTIFIED] = True

    def after_commit(self, shipment: Shipment) -> None:
        self._carrier.info.setdefault(PENDING, []).append((self.handoff, shipment))

    def mark(self) -> int:
        """A position in the waiting messages, to `drop_since` when a savepoint rolls back."""
        return len(self._carrier.info.get(PENDING, ()))

    def drop_since(self, mark: int) -> None:
        del self._carrier.info.get(PENDING, [])[mark:]
