"""`--redrive` and `--redrive-dead`: what a reconciliation may repair, run on the driver after the
classification, and recorded in the report.

- Outbox rows of `not_shipped` messages are put back to `pending`, due now, with no lease and no
  flag, and the relays are woken (NOTIFY): they ship them like any other row. A row leased right now
  (a sender or relay is shipping it at this moment) is left alone. Rows are changed in batches, one
  short transaction each.
- Dead letters: each broker is asked to send the dead letters of each (subject, group) that
  dead-lettered a message of the window back to that group (BROKER_DEAD_REDRIVE: every dead letter of
  the pair not re-driven yet, not only the window's). An ordered message's pair names its queue
  subject `subject#queue`, where its broker keeps the dead letter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

import sqlalchemy as sa

from qmq.db.engine import create_engine
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.schema import PENDING, outbox

log = logging.getLogger("qmq.reconcile")

BATCH_ROWS = 5000
REDRIVE_TIMEOUT_S = 30.0


@dataclass
class RedriveReport:
    outbox: dict[str, int] = field(default_factory=dict)  # database -> rows put back to pending
    outbox_skipped: dict[str, int] = field(default_factory=dict)  # leased right now, or gone
    dead: list[dict] = field(default_factory=list)  # {"broker", "subject", "group", "redriven" | "error"}


def _batches(items: Iterable[str], size: int = BATCH_ROWS) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(islice(it, size)):
        yield batch


def redrive_outbox(urls: dict[str, str], ids_by_database: dict[str, Iterable[str]], report: RedriveReport) -> None:
    """Put the rows of `ids_by_database` back to pending; `urls` maps database names to URLs."""
    now = sa.func.now()
    for name, ids in ids_by_database.items():
        engine = create_engine(urls[name])
        changed = asked = 0
        try:
            for batch in _batches(ids):
                asked += len(batch)
                leased_now = sa.and_(
                    outbox.c.state == PENDING, outbox.c.lease_token.is_not(None), outbox.c.lease_expires_at > now
                )
                statement = (
                    sa.update(outbox)
                    .where(outbox.c.message_id.in_(batch), ~leased_now)
                    .values(
                        state=PENDING,
                        next_attempt_at=now,
                        lease_token=None,
                        lease_expires_at=None,
                        flagged_at=None,
                        sent_at=None,
                    )
                )
                with engine.begin() as conn:
                    changed += conn.execute(statement).rowcount
                    if conn.dialect.name == "postgresql":
                        conn.execute(sa.text(NOTIFY_SQL))
        finally:
            engine.dispose()
        report.outbox[name] = changed
        report.outbox_skipped[name] = asked - changed
        log.warning(
            "re-drove %d outbox rows of %s back to pending (%d left: leased right now, or gone)",
            changed,
            name,
            asked - changed,
        )


def broker_addresses(pairs: list[tuple[str, str]], brokers: list[str], meta: str | None) -> dict[str, list[str]]:
    """subject -> the broker addresses to ask: the ones given, or the subject's route."""
    subjects = sorted({subject for subject, _ in pairs})
    if brokers or meta is None:
        return {s: list(brokers) for s in subjects}
    from qmq.client import Client

    with Client(meta=meta) as client:
        return {s: sorted({a for g in client.route(s).groups for a in g.addresses}) for s in subjects}


def redrive_dead(
    pairs: list[tuple[str, str]], brokers: list[str], meta: str | None, token: str | None, report: RedriveReport
) -> None:
    """Ask every broker of each subject to re-drive the dead letters of each (subject, group)."""
    from qmq.net.client import BlockingConnection
    from qmq.protocol.codes import RequestCode

    addresses = broker_addresses(pairs, brokers, meta)
    for subject, group in sorted(pairs):
        for address in addresses[subject]:
            host, port = address.rsplit(":", 1)
            item = {"broker": address, "subject": subject, "group": group}
            try:
                with BlockingConnection.open(host, int(port), client_id="qmq-reconcile", token=token) as conn:
                    reply = conn.request(
                        RequestCode.BROKER_DEAD_REDRIVE, {"subject": subject, "group": group}, timeout=REDRIVE_TIMEOUT_S
                    )
                item["redriven"] = int(reply["redriven"])
            except Exception as exc:  # one broker down must not hide what the others did
                item["error"] = f"{type(exc).__name__}: {exc}"
                log.error("re-drive of dead letters of %s/%s on %s failed: %s", subject, group, address, exc)
            report.dead.append(item)
