"""A delay server's store in the broker ledger (`qmq ledger export`): each delayed message it
accepted, when it is due, and whether it was handed to a broker or cancelled.

`DelayLedger` replays the records into rows without I/O; `DELAY_STORE` reads the message log, the
cancels and the dispatch logs of a data directory and writes the `delayed` table, as
`qmq.ledger.export` does a broker's tables. A delayed message lives on the delay server until it is
due, then on a broker like any other (same id): the reconciliation counts one that is not yet due as
in flight, not as lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from delay_server import dispatch_log, records
from delay_server.cancels import SUFFIX as CANCELS_SUFFIX
from delay_server.cancels import iter_cancels
from delay_server.verify import iter_scheduled
from qmq.ledger import tables as t
from qmq.ledger.export import ExportJob, StoreKind
from qmq.ledger.replay import EVERYTHING, Window
from qmq.ledger.writer import DayFiles
from qmq.protocol import envelope
from qmq.store.record import Record
from qmq.store.verify import iter_records


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
        if record.flags & records.CANCEL:
            self.cancelled.add(record.message_id)
        elif record.flags & records.DELAYED and record.store_ts in self.window:
            env = envelope.decode(records.body_of(record.payload))
            self._rows.setdefault(
                record.message_id,
                {
                    "message_id": record.message_id,
                    "subject": record.subject,
                    "stored_at": record.store_ts,
                    "due_at": records.due_of(record.payload),
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


def _export_delayed(job: ExportJob) -> None:
    data_dir, report = job.data_dir, job.report
    ledger = DelayLedger(job.window)
    for record in iter_records(data_dir, job.scan):
        ledger.feed(record)
    report.records = ledger.records
    for path in sorted((data_dir / "cancels").glob("*" + CANCELS_SUFFIX)):
        ledger.add_cancels(r.message_id for r in iter_cancels(path))
    by_bucket: dict[str, dict[int, str]] = {}
    for bucket, record in iter_scheduled(data_dir):
        by_bucket.setdefault(bucket, {})[record.offset] = record.message_id
    for bucket, ids in by_bucket.items():
        positions, _damaged = dispatch_log.read_entries(data_dir / "dispatch" / (bucket + dispatch_log.SUFFIX))
        ledger.add_dispatched(ids[p] for p in positions if p in ids)
    delayed = DayFiles(job.out, t.DELAYED, report.name, "stored_at", job.keep)
    try:
        delayed.add_all(ledger.rows())
        report.rows[t.DELAYED] = delayed.commit()
        report.kept_days = sorted(delayed.kept)
    finally:
        delayed.abort()


DELAY_STORE = StoreKind("delay", _export_delayed)
