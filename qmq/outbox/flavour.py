"""What a framework flavour gives the producer: its transactions, and how to open one.

A Producer is made for one database through one framework: SQLAlchemy (`engine=`, `session=`, in
qmq/outbox/sqlalchemy_flavour.py) or Django (`using=`, in qmq/contrib/django/flavour.py). The
producer talks to that flavour only through these protocols, so it knows no framework itself.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import sqlalchemy as sa

from qmq.outbox.shipping import Shipment

Handoff = Callable[[list[Shipment]], None]  # committed messages, to the producer's sender


def hand_over(waiting: list[tuple[Handoff, Shipment]]) -> None:
    """Committed messages to their producers' senders, one call per producer."""
    by_handoff: dict[Handoff, list[Shipment]] = defaultdict(list)
    for handoff, shipment in waiting:
        by_handoff[handoff].append(shipment)
    for handoff, shipments in by_handoff.items():
        handoff(shipments)


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


class Flavour(Protocol):
    """One framework's way to the producer's database."""

    def caller_transaction(self, handoff: Handoff) -> OutboxTransaction | None:
        """The transaction the application has open on this thread that `send` joins without being
        told (a Django `atomic` block, the current Flask-SQLAlchemy session), or None."""

    def given_transaction(self, handoff: Handoff, session: Any, connection: Any) -> OutboxTransaction:
        """The transaction the caller named: `send(..., session=s)` or `send(..., connection=conn)`."""

    def standalone(self, handoff: Handoff) -> contextlib.AbstractContextManager[OutboxTransaction]:
        """A transaction of its own, committed when the block ends; its messages then go to `handoff`."""

    def how_to_join(self) -> str:
        """What the caller can do when `send` finds no transaction (for `NotInTransaction`)."""

    def decorate(self, producer: Any, fn: Callable[..., Any], session: Any) -> Callable[..., Any]:
        """`fn` run as one transaction in which `producer.send` writes (`@qmq.transactional`)."""

    def engine(self) -> sa.Engine:
        """The engine the sender reads and marks rows with (connections of its own)."""

    def database_name(self) -> str:
        """The database's name, as the `qmq-producer` header gives it."""

    def close(self) -> None:
        """The producer closed: release what the flavour made for itself (never the application's)."""
