"""Shipping ordered outbox rows (docs/ordering.md): a later row of a (subject, order_key) never reaches
a broker before an earlier one, with any number of app processes and relays on one database.

Outbox order is the row's `id` (the order rows were written). Whoever ships rows of a key, the
after-commit sender or a relay, does it inside one database transaction that holds the key's
transaction-scoped advisory lock (`pg_try_advisory_xact_lock`, a hash of subject and key) and the
rows' locks: it reads the key's pending rows oldest first, sends the run it may ship, marks what a
broker acknowledged as sent and commits, which releases the lock. Two shippers never ship one key at
once; a key whose lock is taken is skipped, not waited for; a shipper that dies mid-way loses its
lock with its connection and the next one sends the same rows again (a duplicate, in order).

A run is sent in waves, the i-th row of every key in the i-th `Client.send`, because a client sends
the batches of one call in parallel: a key has one message in flight at a time. A key stops at its
first failure: that row gets the outbox's backoff and every later row of the key waits behind it.

SQLite has no advisory locks; its single writer serialises shippers instead (the transaction writes
first). The promise holds on PostgreSQL with many shippers and on SQLite with one process.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from qmq.client.blocking import Client
from qmq.outbox import rows
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.rows import ClaimedRow, Failure
from qmq.outbox.schema import PENDING, SENT, outbox
from qmq.outbox.shipping import Shipment, send, shipment

log = logging.getLogger(__name__)

RELAY_KEYS = 256  # keys a relay ships in one transaction
RELAY_ROWS_PER_KEY = 16  # rows of one key in one transaction (one wave each)
HEAD_CANDIDATES = 4096  # keys whose oldest row is ready, looked at per pass (shuffled, then locked)

Key = tuple[str, str]  # (subject, order_key)


def lock_id(subject: str, order_key: str) -> int:
    """The advisory lock of one key: a signed 64-bit hash, the same in every process."""
    digest = hashlib.blake2b(f"qmq-order\x00{subject}\x00{order_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass
class OrderedReport:
    sent: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    given_back: list[str] = field(default_factory=list)  # left to the relay (an earlier row, or a locked key)
    keys: int = 0  # keys shipped


def _begin_writing(conn: sa.Connection) -> None:
    """SQLite: take the database's write lock now, so that shippers of one database take turns."""
    if conn.dialect.name == "sqlite":
        conn.execute(outbox.update().where(outbox.c.id == -1).values(order_key=outbox.c.order_key))


def lock_keys(conn: sa.Connection, keys: Sequence[Key], limit: int | None = None) -> list[Key]:
    """Take the advisory locks of `keys` that nobody holds (at most `limit`), for the transaction;
    the keys locked. Without advisory locks (SQLite), all of them."""
    if not keys:
        return []
    if conn.dialect.name != "postgresql":
        return list(keys[:limit] if limit else keys)
    ids = [lock_id(s, k) for s, k in keys]
    stmt = sa.text(
        "SELECT n FROM unnest(CAST(:ids AS BIGINT[])) WITH ORDINALITY AS t(lock, n) "
        "WHERE pg_try_advisory_xact_lock(lock) LIMIT :limit"  # the executor stops at the limit: no extra locks
    ).bindparams(sa.bindparam("ids", ids, type_=postgresql.ARRAY(sa.BigInteger)), limit=limit)
    return [keys[int(n) - 1] for n in conn.execute(stmt).scalars()]


def _rank() -> sa.ColumnElement:
    """A row's place among its key's pending rows (1: the oldest)."""
    return sa.func.row_number().over(partition_by=(outbox.c.subject, outbox.c.order_key), order_by=outbox.c.id)


def _key_rows(conn: sa.Connection, keys: Sequence[Key], per_key: int) -> dict[Key, list[sa.Row]]:
    """The oldest `per_key` pending rows of each key, locked, oldest first, with whether each is due."""
    if not keys:
        return {}
    now = rows.db_now(conn.dialect.name)
    ranked = (
        sa.select(
            outbox.c.id,
            sa.func.row_number()
            .over(partition_by=(outbox.c.subject, outbox.c.order_key), order_by=outbox.c.id)
            .label("rn"),
        )
        .where(outbox.c.state == PENDING, sa.tuple_(outbox.c.subject, outbox.c.order_key).in_(list(keys)))
        .subquery()
    )
    stmt = (
        sa.select(*rows._CLAIMED_COLUMNS, outbox.c.lease_token, (outbox.c.next_attempt_at <= now).label("due"))
        .where(outbox.c.id.in_(sa.select(ranked.c.id).where(ranked.c.rn <= per_key)))
        .order_by(outbox.c.id)
    )
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update(of=outbox)
    out: dict[Key, list[sa.Row]] = {}
    for row in conn.execute(stmt):
        out.setdefault((row.subject, row.order_key), []).append(row)
    return out


def _claimed(row: sa.Row) -> ClaimedRow:
    return ClaimedRow(*row[: len(rows._CLAIMED_COLUMNS)])


def _send_in_waves(client: Client, runs: dict[Key, list[Shipment]], report: OrderedReport) -> None:
    """Send each key's run in order, one message of a key per `Client.send`; a key stops at its first
    failure. Fills `report.sent` and `report.failed`."""
    position = 0
    live = [key for key, run in runs.items() if run]
    while live:
        wave = [runs[key][position] for key in live]
        results = send(client, wave)
        still = []
        for key, item, result in zip(live, wave, results, strict=True):
            if result.ok:
                report.sent.append(item.message.id)
                if position + 1 < len(runs[key]):
                    still.append(key)
            else:
                error = result.error or f"error code {result.error_code}"
                report.failed.append(Failure(item.message.id, error, item.attempts))
        live = still
        position += 1


def _record(conn: sa.Connection, report: OrderedReport) -> None:
    """Mark the sent rows and give the failed ones their backoff (the rows are locked by us)."""
    dialect = conn.dialect.name
    if report.sent:
        conn.execute(
            outbox.update()
            .where(outbox.c.message_id.in_(report.sent), outbox.c.state == PENDING)
            .values(
                state=SENT,
                sent_at=rows.db_now(dialect),
                attempts=outbox.c.attempts + 1,
                lease_token=None,
                lease_expires_at=None,
                last_error=None,
            )
        )
    if report.failed:
        conn.execute(
            outbox.update()
            .where(outbox.c.message_id == sa.bindparam("m_id"), outbox.c.state == PENDING)
            .values(
                attempts=outbox.c.attempts + 1,
                last_error=sa.bindparam("m_error"),
                next_attempt_at=rows.db_now_plus(dialect, sa.bindparam("m_delay", type_=sa.Float)),
                lease_token=None,
                lease_expires_at=None,
            ),
            [
                {
                    "m_id": f.message_id,
                    "m_error": f.error[: rows.LAST_ERROR_MAX_CHARS],
                    "m_delay": rows.retry_delay_s(f.attempts + 1),
                }
                for f in report.failed
            ],
        )


def _give_back(conn: sa.Connection, message_ids: Sequence[str], token: str) -> None:
    """Unlease rows at once, for the relay (with a NOTIFY to wake it after the commit)."""
    if not message_ids:
        return
    # Rows another shipper holds locked are skipped, never waited for (waiting could deadlock): it is
    # shipping their key, so it takes them over, or their lease runs out and a relay ships them.
    free = (
        sa.select(outbox.c.id)
        .where(outbox.c.message_id.in_(list(message_ids)), outbox.c.lease_token == token, outbox.c.state == PENDING)
        .with_for_update(skip_locked=True)
    )
    conn.execute(outbox.update().where(outbox.c.id.in_(free)).values(lease_token=None, lease_expires_at=None))
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text(NOTIFY_SQL))


# ---- the after-commit sender -------------------------------------------------------------------------


def ship_offered(
    conn: sa.Connection, client: Client, shipments: Sequence[Shipment], token: str, lease_s: float
) -> OrderedReport:
    """Ship ordered messages the after-commit sender was handed (rows leased to `token`): a key's
    rows only when no earlier row of the key is pending; the others are given back to the relay. A
    transaction left idle longer than `lease_s` is ended by the server (`rows.set_local_settings`)."""
    report = OrderedReport()
    mine = {s.message.id: s for s in shipments}
    keys = sorted({(s.message.subject, s.message.order_key) for s in shipments if s.message.order_key})
    with conn.begin():
        _begin_writing(conn)
        rows.set_local_settings(conn, lease_s)
        locked = lock_keys(conn, keys)
        locked_set = set(locked)
        report.given_back += [i for i, s in mine.items() if (s.message.subject, s.message.order_key) not in locked_set]
        per_key = (
            max(sum(1 for s in shipments if (s.message.subject, s.message.order_key) == k) for k in keys) if keys else 0
        )
        pending = _key_rows(conn, locked, per_key + 1)
        runs: dict[Key, list[Shipment]] = {}
        for key in locked:
            run: list[Shipment] = []
            for row in pending.get(key, ()):
                if row.message_id not in mine or row.lease_token != token or not row.due:
                    break  # an earlier row of the key is someone else's, or waits: the relay ships in order
                run.append(mine[row.message_id])
            runs[key] = run
            shipped = {s.message.id for s in run}
            report.given_back += [
                i for i, s in mine.items() if (s.message.subject, s.message.order_key) == key and i not in shipped
            ]
        _send_in_waves(client, runs, report)
        report.keys = sum(1 for run in runs.values() if run)
        _record(conn, report)
        _give_back(conn, report.given_back, token)
    return report


# ---- the relay -----------------------------------------------------------------------------------------


def _ready_heads(conn: sa.Connection) -> list[Key]:
    """Keys whose oldest pending row may be shipped now (due, not leased to a live holder)."""
    now = rows.db_now(conn.dialect.name)
    heads = (
        sa.select(
            outbox.c.subject,
            outbox.c.order_key,
            outbox.c.next_attempt_at,
            outbox.c.lease_expires_at,
            sa.func.row_number()
            .over(partition_by=(outbox.c.subject, outbox.c.order_key), order_by=outbox.c.id)
            .label("rn"),
        )
        .where(outbox.c.state == PENDING, outbox.c.order_key.is_not(None))
        .subquery()
    )
    stmt = (
        sa.select(heads.c.subject, heads.c.order_key)
        .where(
            heads.c.rn == 1,
            heads.c.next_attempt_at <= now,
            sa.or_(heads.c.lease_expires_at.is_(None), heads.c.lease_expires_at <= now),
        )
        .limit(HEAD_CANDIDATES)
    )
    return [(s, k) for s, k in conn.execute(stmt)]


def ship_ready_keys(
    conn: sa.Connection,
    client: Client,
    lease_s: float,
    *,
    max_keys: int = RELAY_KEYS,
    per_key: int = RELAY_ROWS_PER_KEY,
) -> OrderedReport | None:
    """One relay pass over ordered rows: lock up to `max_keys` keys whose oldest row is ready, ship
    each key's run of due rows (rows leased to a sender are taken over: under the key's lock nobody
    else ships them) and record the outcome; None when no key was ready. A transaction left idle
    longer than `lease_s` is ended by the server (`rows.set_local_settings`)."""
    with conn.begin():
        _begin_writing(conn)
        candidates = _ready_heads(conn)
        if not candidates:
            return None
        random.shuffle(candidates)  # relays sharing a database start on different keys
        rows.set_local_settings(conn, lease_s)
        locked = lock_keys(conn, candidates, max_keys)
        if not locked:
            return OrderedReport()
        pending = _key_rows(conn, locked, per_key)
        runs: dict[Key, list[Shipment]] = {}
        for key in locked:
            run = []
            for row in pending.get(key, ()):
                if not row.due:
                    break  # a failed row waits for its backoff, and the key behind it
                run.append(shipment(_claimed(row)))
            runs[key] = run
        report = OrderedReport()
        _send_in_waves(client, runs, report)
        report.keys = sum(1 for run in runs.values() if run)
        _record(conn, report)
    return report
