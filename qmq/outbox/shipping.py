"""Shipping leased outbox rows: send them through a qmq client, then record per row what happened
(sent, or failed with its error and a backoff) under the lease. The after-commit sender and the relay
both ship this way; they differ only in how they lease rows.

Promise: a row is marked sent only after a broker (or the delay server) acknowledged its message:
either the mark is written after the acknowledgement (`ship`), or it is written before the send in a
transaction that commits only after it (`ship_taken`, PostgreSQL). If the marking or the commit fails
(the database went away), the rows stay pending and are shipped again: a possible duplicate, never a
loss. Consumers drop duplicates by message id.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy as sa

from qmq.client.blocking import Client
from qmq.client.messages import OutgoingMessage, SendResult
from qmq.outbox import rows
from qmq.outbox.rows import ClaimedRow, Failure

log = logging.getLogger(__name__)


@dataclass
class Shipment:
    """One message to ship with the attempts its row has had so far."""

    message: OutgoingMessage
    attempts: int = 0
    queued_at: float = 0.0  # time.monotonic() when handed to a sender


@dataclass
class ShipReport:
    sent: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    lease_lost: int = 0  # rows marked by no one: another holder took them after our lease expired


def epoch_ms(value: datetime | int) -> int:
    """ms since the epoch; a naive datetime (SQLite) is UTC; an int is ms already."""
    if isinstance(value, int):
        return value
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return int(value.timestamp() * 1000)


def shipment(row: ClaimedRow) -> Shipment:
    """The message a claimed row stands for, with the id, body and creation time it was written with."""
    message = OutgoingMessage(
        row.subject,
        row.body,
        key=row.key,
        tags=tuple(row.tags or ()),
        headers=row.headers or None,
        id=row.message_id,
        created_at=epoch_ms(row.created_at),
        content_type=row.content_type,
        deliver_at=None if row.deliver_at is None else epoch_ms(row.deliver_at),
        order_key=row.order_key,
    )
    return Shipment(message, row.attempts)


def send(client: Client, shipments: Sequence[Shipment]) -> list[SendResult]:
    """One result per shipment; a client that raised fails them all with its error."""
    messages = [s.message for s in shipments]
    try:
        return client.send(messages)
    except Exception as exc:  # the client could not even try: meta server down, closed client...
        return [SendResult(m.id, m.subject, False, error=f"{type(exc).__name__}: {exc}") for m in messages]


def ship(conn: sa.Connection, client: Client, shipments: Sequence[Shipment], token: str) -> ShipReport:
    """Send `shipments` (rows leased to `token`) and record the outcome of each row on `conn` (not in
    a transaction). Raises only if the outcome could not be written (the rows then wait for their
    lease to expire)."""
    report = ShipReport()
    by_id = {s.message.id: s for s in shipments}
    for result in send(client, shipments):
        if result.ok:
            report.sent.append(result.message_id)
        else:
            error = result.error or f"error code {result.error_code}"
            report.failed.append(Failure(result.message_id, error, by_id[result.message_id].attempts))
    with conn.begin():
        marked = rows.mark_sent(conn, report.sent, token) + rows.mark_failed(conn, report.failed, token)
    report.lease_lost = len(shipments) - marked
    if report.lease_lost:
        log.warning(
            "%d outbox rows were shipped after their lease expired; another relay may ship them again "
            "(consumers drop the duplicate by message id)",
            report.lease_lost,
        )
    return report


def ship_taken(conn: sa.Connection, client: Client, shipments: Sequence[Shipment]) -> ShipReport:
    """Send `shipments`, whose rows this transaction of `conn` took (`rows.take_due`,
    `rows.take_leased`), and give the failed ones back in it; the caller then commits. Raises only if
    the give-back could not be written (the caller's transaction then rolls back: every row pending)."""
    report = ShipReport()
    attempts = {s.message.id: s.attempts for s in shipments}
    for result in send(client, shipments):
        if result.ok:
            report.sent.append(result.message_id)
        else:
            error = result.error or f"error code {result.error_code}"
            report.failed.append(Failure(result.message_id, error, attempts[result.message_id]))
    rows.give_back(conn, report.failed)
    return report
