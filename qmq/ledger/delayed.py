"""A delay server's store, replayed into ledger rows: each delayed message it accepted, when it is
due, and whether it was handed to a broker or cancelled. Nothing here does I/O: the export feeds it
the message log's records, the ids in the dispatch logs, and the cancels.

A delayed message lives on the delay server until it is due, then on a broker like any other (same
id): the reconciliation counts one that is not yet due as in flight, not as lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from delay_server import records as delay_records
from qmq.ledger import tables as t
from qmq.ledger.replay import EVERYTHING, Window
from qmq.protocol import envelope
from qmq.store.record import Record


class DelayLedger:
    def __init__(self, window: Window = EVERYTHING) -> None:
        self.window = window
        self._rows: dict[str, dict[str, Any]] = {}  # message id -> row (a message is accepted once)
        self.cancelled: set[str] = set()
        self.dispatched: set[str] = set()
        self.records = 0

    def feed(self, record: Record) -> None:
        """A record of the delay server's message log, in log order."""
        self.records += 1
        if record.flags & delay_records.CANCEL:
            self.cancelled.add(record.message_id)
        elif record.flags & delay_records.DELAYED and record.store_ts in self.window:
            env = envelope.decode(delay_records.body_of(record.payload))
            self._rows.setdefault(
                record.message_id,
                {
                    "message_id": record.message_id,
                    "subject": record.subject,
                    "stored_at": record.store_ts,
                    "due_at": delay_records.due_of(record.payload),
                    "created_at": env.created_at,
                    "producer": env.headers.get(t.PRODUCER_HEADER),
                },
            )

    def add_cancels(self, message_ids: Iterable[str]) -> None:
        self.cancelled.update(message_ids)

    def add_dispatched(self, message_ids: Iterable[str]) -> None:
        self.dispatched.update(message_ids)

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                **row,
                "dispatched": row["message_id"] in self.dispatched,
                "cancelled": row["message_id"] in self.cancelled,
            }
            for row in self._rows.values()
        ]
