"""The outbox's SQL: every statement that the producer, its after-commit sender and the relay run on
`qmq_outbox`, for PostgreSQL and SQLite, with times from the database clock (so that hosts with skewed
clocks agree on leases). No threads, no retries: the caller holds the connection and the transaction.

Promises: a row is shipped only by the holder of its lease (`lease_token` until `lease_expires_at`)
and marked sent only under that token, so senders and relays sharing a database never ship a row
twice while they are healthy; a holder that died loses its rows when its lease expires.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from qmq.db.ddl import dialect as ddl_dialect
from qmq.outbox.schema import PENDING, SENT, outbox

SQLITE_TIME_FORMAT = "%Y-%m-%d %H:%M:%f"  # UTC, sorts as text, read back by SQLAlchemy's DateTime
RETRY_BASE_S = 1.0  # a row that failed once waits this long, then doubling...
RETRY_MAX_S = 300.0  # ...up to this
LAST_ERROR_MAX_CHARS = 2000
FLAG_CLOCK_SLACK_S = 1.0  # `Backlog.may_need_flagging`: the two statements' clocks may differ this much
DUE_LOOKAHEAD_ROWS = 100  # pending rows, soonest first, that `seconds_until_due` looks at


def db_now(dialect: str) -> sa.ColumnElement:
    """The database's current time."""
    if dialect == "sqlite":
        return sa.func.strftime(SQLITE_TIME_FORMAT, "now")
    return sa.func.now()


def db_now_plus(dialect: str, seconds: float | sa.BindParameter) -> sa.ColumnElement:
    """The database's current time plus `seconds` (a number or a bound parameter)."""
    if dialect == "sqlite":
        return sa.func.strftime(SQLITE_TIME_FORMAT, "now", sa.func.printf("%+.3f seconds", seconds))
    return sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds)


def retry_delay_s(attempts: int) -> float:
    """How long a row waits after its `attempts`-th failed attempt: exponential with a cap."""
    return min(RETRY_BASE_S * 2 ** min(max(attempts - 1, 0), 30), RETRY_MAX_S)


_INSERTS: dict[tuple[str, bool], sa.Insert] = {}


def insert(dialect: str, leased: bool) -> sa.Insert:
    """The INSERT of new rows. Parameters: the columns of the row, and when `leased`, `lease_token`
    and `lease_s`: the row is born leased to its producer's sender for `lease_s`, so relays leave it
    to that sender unless it dies. Built once per kind (the application calls it in every transaction)."""
    stmt = _INSERTS.get((dialect, leased))
    if stmt is None:
        stmt = outbox.insert()
        if leased:
            stmt = stmt.values(lease_expires_at=db_now_plus(dialect, sa.bindparam("lease_s", type_=sa.Float)))
        stmt = _INSERTS[(dialect, leased)] = stmt
    return stmt


INSERT_COLUMNS = (
    "message_id",
    "subject",
    "body",
    "content_type",
    "headers",
    "tags",
    "key",
    "deliver_at",
    "order_key",
)


@dataclass(frozen=True)
class CompiledInsert:
    """The INSERT of one row as SQL text for a DB-API cursor, with its parameters in order and
    converted as SQLAlchemy would (JSON encoded, SQLite datetimes as text). The producer runs it in
    every business transaction, so it skips SQLAlchemy's per-statement work."""

    sql: str
    names: tuple[str, ...]
    defaults: dict[str, Any]
    processors: dict[str, Callable[[Any], Any]]

    def parameters(self, values: dict[str, Any]) -> list[Any]:
        out = []
        for name in self.names:
            value = values[name] if name in values else self.defaults.get(name)
            processor = self.processors.get(name)
            out.append(processor(value) if processor is not None and value is not None else value)
        return out


_COMPILED: dict[tuple[str, bool, str], CompiledInsert] = {}


def compiled_insert(dialect: str, leased: bool, paramstyle: str) -> CompiledInsert:
    """`insert(dialect, leased)` for cursors of `paramstyle` ("format": psycopg and Django cursors,
    "qmark": sqlite3); parameters as for `insert`."""
    key = (dialect, leased, paramstyle)
    if key not in _COMPILED:
        d = ddl_dialect(dialect)
        columns = [*INSERT_COLUMNS, "lease_token"] if leased else list(INSERT_COLUMNS)
        compiled = insert(dialect, leased).compile(dialect=type(d)(paramstyle=paramstyle), column_keys=columns)
        processors = {c.name: p for c in outbox.columns if (p := c.type.bind_processor(d)) is not None}
        _COMPILED[key] = CompiledInsert(
            str(compiled), tuple(compiled.positiontup or ()), dict(compiled.params), processors
        )
    return _COMPILED[key]


def insert_with_cursor(
    cursor: Any, dialect: str, paramstyle: str, values: dict[str, Any], lease_token: str | None, lease_s: float
) -> None:
    """INSERT one new row through a DB-API `cursor` of the application's transaction (a SQLAlchemy
    connection's or Django's), leased to `lease_token` for `lease_s` when a token is given."""
    params = {**values, "lease_token": lease_token, "lease_s": lease_s} if lease_token else values
    statement = compiled_insert(dialect, lease_token is not None, paramstyle)
    cursor.execute(statement.sql, statement.parameters(params))


def insert_on_connection(
    connection: sa.Connection, values: dict[str, Any], lease_token: str | None, lease_s: float
) -> None:
    """`insert_with_cursor` on the DB-API connection under a SQLAlchemy `connection` in a transaction."""
    dialect = connection.dialect.name
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        insert_with_cursor(cursor, dialect, "qmark" if dialect == "sqlite" else "format", values, lease_token, lease_s)
    finally:
        cursor.close()


def _one_of(conn: sa.Connection, column: sa.Column, values: Sequence[Any]) -> sa.ColumnElement:
    """`column` is one of `values`: one array parameter on PostgreSQL (a thousand-value IN list costs
    more to parse and plan than to run), an IN list elsewhere."""
    if conn.dialect.name == "postgresql":
        return column == sa.any_(sa.literal(list(values), type_=postgresql.ARRAY(column.type)))
    return column.in_(values)


class ClaimedRow(NamedTuple):
    """A pending row as a sender or relay ships it (a named tuple: made per row, in the relay's loop)."""

    message_id: str
    subject: str
    body: bytes
    content_type: str
    headers: dict | None
    tags: list | None
    key: str | None
    deliver_at: object  # datetime or None (ms since the epoch from `take_due`)
    attempts: int
    created_at: object  # datetime (ms since the epoch from `take_due`)
    order_key: str | None = None
    id: int = 0  # the row's place in outbox order


def _claimed_row(values: tuple) -> ClaimedRow:
    """A fetched row as a `ClaimedRow` (tuple.__new__: `ClaimedRow._make` is Python code, per row)."""
    return tuple.__new__(ClaimedRow, values)


_CLAIMED_COLUMNS = (
    outbox.c.message_id,
    outbox.c.subject,
    outbox.c.body,
    outbox.c.content_type,
    outbox.c.headers,
    outbox.c.tags,
    outbox.c.key,
    outbox.c.deliver_at,
    outbox.c.attempts,
    outbox.c.created_at,
    outbox.c.order_key,
    outbox.c.id,
)


def _claimable(now: sa.ColumnElement) -> sa.ColumnElement:
    """Unordered rows due now and not leased; ordered rows go by `qmq.outbox.ordered_rows`."""
    return sa.and_(
        outbox.c.state == PENDING,
        outbox.c.order_key.is_(None),
        outbox.c.next_attempt_at <= now,
        sa.or_(outbox.c.lease_expires_at.is_(None), outbox.c.lease_expires_at <= now),
    )


def _due_ids(now: Any, limit: int) -> sa.Select:
    """The ids of up to `limit` rows to ship, oldest due first, skipping rows another transaction
    holds locked (PostgreSQL; SQLite has no row locks and ignores it)."""
    return (
        sa.select(outbox.c.id)
        .where(_claimable(now))
        .order_by(outbox.c.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def claim_due(conn: sa.Connection, token: str, limit: int, lease_s: float) -> list[ClaimedRow]:
    """Lease up to `limit` due pending rows, oldest due first, to `token` for `lease_s`. Rows that
    another transaction holds locked are skipped (PostgreSQL), not waited for."""
    dialect = conn.dialect.name
    stmt = (
        outbox.update()
        .where(outbox.c.id.in_(_due_ids(db_now(dialect), limit)))
        .values(lease_token=token, lease_expires_at=db_now_plus(dialect, lease_s))
        .returning(*_CLAIMED_COLUMNS)
    )
    return [ClaimedRow(*row) for row in conn.execute(stmt)]


# ---- PostgreSQL: take rows in the shipping transaction -------------------------------------------------
#
# On PostgreSQL a sender or relay ships in one transaction: one UPDATE marks a batch sent and returns it
# (`take_due`, `take_leased`), the broker stores it, failures are given back (`give_back`), and only
# then does the transaction commit. Until the commit nobody else sees the mark, and the row locks the
# UPDATE holds are the lease: other shippers skip them (SKIP LOCKED), a shipper that dies drops them
# with its connection at once, and one that hangs is cut off after the lease by
# `idle_in_transaction_session_timeout`. One write per row instead of a claim and a mark, and one round
# trip less per batch.
#
# Settings and statements are the transaction's own, never the session's, because the connection is
# the application's and may be a PgBouncer server connection shared in transaction mode: the takes set
# what they need with `set_config(..., true)` inside their own statement (`_settings`, no extra
# round trip), and are not prepared (a named statement would live on one server connection only). An
# unprepared statement is also planned for its parameters and the table as it is each time: a generic
# plan, cached on a connection held for hours while the table was small, read all of it on every take
# once it had grown.


def _settings() -> sa.Select:
    """What a shipping transaction sets for itself (parameter `lease_ms`, as text): a transaction left
    idle longer than the lease (a send that hangs) is ended by the server, its rows given back; and
    its commit does not wait for its WAL flush: a mark lost in a PostgreSQL crash means the row is
    shipped again (a duplicate, which consumers drop by id), never a lost message."""
    lease = sa.bindparam("lease_ms", type_=sa.Text)
    return sa.select(
        sa.func.set_config("idle_in_transaction_session_timeout", lease, True).label("idle_timeout"),
        sa.func.set_config("synchronous_commit", "off", True).label("synchronous_commit"),
    )


def _taking(where: sa.ColumnElement, returning: Sequence[sa.ColumnElement]) -> sa.Update:
    """The take: mark the rows `where` selects sent, and set the transaction's settings (`_settings`)
    in the same statement, as a one-row CTE the UPDATE joins: computed once; a take that finds no row
    may skip it, and then has nothing to protect."""
    settings = _settings().cte("qmq_local_settings")
    return (
        outbox.update()
        .add_cte(settings)
        .where(where, settings.c.synchronous_commit.is_not(None))
        .values(**_mark_taken())
        .returning(*returning)
    )


def set_local_settings(conn: sa.Connection, lease_s: float) -> None:
    """PostgreSQL, at the start of a shipping transaction that takes no rows by `take_due` or
    `take_leased` (ordered shipping): the takes' settings (`_settings`), for this transaction only.
    Elsewhere nothing."""
    if conn.dialect.name == "postgresql":
        conn.execute(_settings(), {"lease_ms": lease_ms(lease_s)})


def lease_ms(lease_s: float) -> str:
    """A lease as `idle_in_transaction_session_timeout` takes it through set_config: whole ms, text."""
    return str(max(1, int(lease_s * 1000)))


def _mark_taken() -> dict[str, Any]:
    return {
        "state": SENT,
        "sent_at": sa.func.now(),
        "attempts": outbox.c.attempts + 1,
        "lease_token": None,
        "lease_expires_at": None,
        "last_error": None,
    }


_TAKE_DUE: dict[int, tuple[str, dict[str, Any]]] = {}


def take_due(conn: sa.Connection, limit: int, lease_s: float) -> list[ClaimedRow]:
    """PostgreSQL, in the caller's open transaction: mark up to `limit` due, unleased, unordered rows
    sent, oldest due first, and return them; rows another transaction holds are skipped. The caller
    ships them, gives the failures back and commits within `lease_s` (idle longer, the server ends the
    transaction); a rollback (or a lost connection) leaves them all pending. The statement is compiled
    once and run on the DB-API cursor: it is the relay's inner loop."""
    sql = _TAKE_DUE.get(limit)
    if sql is None:
        due = _due_ids(sa.func.now(), limit)
        # RETURNING gives the new values: attempts as they were before this one, as `claim_due` does;
        # times as ms since the epoch, as a message carries them (no datetime made per row).
        replaced = {
            "attempts": (outbox.c.attempts - 1).label("attempts"),
            "created_at": _epoch_ms(outbox.c.created_at).label("created_at"),
            "deliver_at": _epoch_ms(outbox.c.deliver_at).label("deliver_at"),
        }
        returned = [replaced.get(c.name, c) for c in _CLAIMED_COLUMNS]
        compiled = _taking(outbox.c.id.in_(due), returned).compile(dialect=conn.dialect)
        sql = _TAKE_DUE[limit] = (str(compiled), dict(compiled.params))
    # binary: bodies arrive as bytes, not as hex text to decode
    cursor = conn.connection.dbapi_connection.cursor(binary=True)  # type: ignore[union-attr]
    try:
        cursor.execute(sql[0], {**sql[1], "lease_ms": lease_ms(lease_s)}, prepare=False)
        return list(map(_claimed_row, cursor.fetchall()))
    finally:
        cursor.close()


def _epoch_ms(column: sa.Column) -> sa.ColumnElement:
    """PostgreSQL: a timestamp column as whole ms since the epoch (NULL stays NULL)."""
    return sa.cast(sa.func.floor(sa.extract("epoch", column) * 1000), sa.BigInteger)


_TAKE_LEASED: list[tuple[str, dict[str, Any]]] = []


def take_leased(conn: sa.Connection, message_ids: Sequence[str], token: str, lease_s: float) -> set[str]:
    """PostgreSQL, in the caller's open transaction: mark sent the rows among `message_ids` that exist,
    are pending and leased to `token`, skipping any another transaction holds; their ids. A row rolled
    back with its transaction (or savepoint) is not there. Then as for `take_due`; compiled once and
    run on the DB-API cursor, as the after-commit sender runs it for every batch."""
    if not message_ids:
        return set()
    if not _TAKE_LEASED:
        ids = sa.bindparam("ids", type_=postgresql.ARRAY(outbox.c.message_id.type))
        mine = (
            sa.select(outbox.c.id)
            .where(outbox.c.message_id == sa.any_(ids), outbox.c.lease_token == sa.bindparam("token"))
            .where(outbox.c.state == PENDING)
            .with_for_update(skip_locked=True)
        )
        compiled = _taking(outbox.c.id.in_(mine), [outbox.c.message_id]).compile(dialect=conn.dialect)
        _TAKE_LEASED.append((str(compiled), dict(compiled.params)))
    sql, params = _TAKE_LEASED[0]
    values = {**params, "ids": list(message_ids), "token": token, "lease_ms": lease_ms(lease_s)}
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(sql, values, prepare=False)
        return {row[0] for row in cursor.fetchall()}
    finally:
        cursor.close()


def give_back(conn: sa.Connection, failures: Sequence[Failure]) -> int:
    """In the transaction that took them (`take_due`, `take_leased`): rows whose send failed go back to
    pending with the error and a backoff (their attempt is already counted); the number given back."""
    if not failures:
        return 0
    stmt = (
        outbox.update()
        .where(outbox.c.message_id == sa.bindparam("m_id"), outbox.c.state == SENT)
        .values(
            state=PENDING,
            sent_at=None,
            last_error=sa.bindparam("m_error"),
            next_attempt_at=db_now_plus(conn.dialect.name, sa.bindparam("m_delay", type_=sa.Float)),
        )
    )
    params = [
        {"m_id": f.message_id, "m_error": f.error[:LAST_ERROR_MAX_CHARS], "m_delay": retry_delay_s(f.attempts + 1)}
        for f in failures
    ]
    return conn.execute(stmt, params).rowcount


def still_leased(conn: sa.Connection, message_ids: Sequence[str], token: str) -> set[str]:
    """The ids among `message_ids` whose rows exist, are pending and still leased to `token`. A row
    rolled back with its transaction (or savepoint) is not there. A read: no write, no fsync."""
    if not message_ids:
        return set()
    stmt = sa.select(outbox.c.message_id).where(
        _one_of(conn, outbox.c.message_id, message_ids), outbox.c.lease_token == token, outbox.c.state == PENDING
    )
    return set(conn.execute(stmt).scalars())


def mark_sent(conn: sa.Connection, message_ids: Iterable[str], token: str) -> int:
    """Mark the rows sent, if still leased to `token`; the number marked."""
    ids = list(message_ids)
    if not ids:
        return 0
    stmt = (
        outbox.update()
        .where(_one_of(conn, outbox.c.message_id, ids), outbox.c.lease_token == token, outbox.c.state == PENDING)
        .values(
            state=SENT,
            sent_at=db_now(conn.dialect.name),
            attempts=outbox.c.attempts + 1,
            lease_token=None,
            lease_expires_at=None,
            last_error=None,
        )
    )
    return conn.execute(stmt).rowcount


@dataclass(frozen=True)
class Failure:
    """A row that could not be shipped: why, and its attempts so far (before this one)."""

    message_id: str
    error: str
    attempts: int


def mark_failed(conn: sa.Connection, failures: Sequence[Failure], token: str) -> int:
    """Give the rows back (if still leased to `token`) with one more attempt, the error, and a next
    attempt after the backoff; the number updated."""
    if not failures:
        return 0
    stmt = (
        outbox.update()
        .where(outbox.c.message_id == sa.bindparam("m_id"), outbox.c.lease_token == token, outbox.c.state == PENDING)
        .values(
            attempts=outbox.c.attempts + 1,
            last_error=sa.bindparam("m_error"),
            next_attempt_at=db_now_plus(conn.dialect.name, sa.bindparam("m_delay", type_=sa.Float)),
            lease_token=None,
            lease_expires_at=None,
        )
    )
    params = [
        {"m_id": f.message_id, "m_error": f.error[:LAST_ERROR_MAX_CHARS], "m_delay": retry_delay_s(f.attempts + 1)}
        for f in failures
    ]
    return conn.execute(stmt, params).rowcount


def flag_overdue(conn: sa.Connection, pending_for_s: float, attempts: int) -> list[sa.Row]:
    """Flag (set `flagged_at` on) pending rows not yet flagged that are older than `pending_for_s` or
    have failed `attempts` times; the rows flagged now (message_id, subject, attempts, last_error)."""
    dialect = conn.dialect.name
    stmt = (
        outbox.update()
        .where(
            outbox.c.state == PENDING,
            outbox.c.flagged_at.is_(None),
            sa.or_(outbox.c.created_at <= db_now_plus(dialect, -pending_for_s), outbox.c.attempts >= attempts),
        )
        .values(flagged_at=db_now(dialect))
        .returning(outbox.c.message_id, outbox.c.subject, outbox.c.attempts, outbox.c.last_error)
    )
    return list(conn.execute(stmt))


def purge_sent(conn: sa.Connection, sent_before_s: float, limit: int) -> int:
    """Delete up to `limit` rows sent more than `sent_before_s` ago; the number deleted. Callers run it
    in short transactions, one batch each, so no lock is held for long."""
    old = (
        sa.select(outbox.c.id)
        .where(outbox.c.state == SENT, outbox.c.sent_at <= db_now_plus(conn.dialect.name, -sent_before_s))
        .order_by(outbox.c.sent_at)
        .limit(limit)
    )
    return conn.execute(outbox.delete().where(outbox.c.id.in_(old))).rowcount


@dataclass(frozen=True)
class Backlog:
    """The pending rows of one outbox: how many, the oldest one's age, how many are flagged, and the
    most failed attempts of one (whether any row can be due for flagging)."""

    pending: int
    oldest_age_s: float
    flagged: int
    most_attempts: int = 0

    def may_need_flagging(self, pending_for_s: float, attempts: int) -> bool:
        """Whether `flag_overdue` can find a row: one pending `pending_for_s` (less a second for the
        clocks of two statements) or failed `attempts` times. Both are read in one scan of the pending
        rows, where flagging is a second one; with a backlog of a million rows each scan costs the
        database a second or more."""
        return self.oldest_age_s >= pending_for_s - FLAG_CLOCK_SLACK_S or self.most_attempts >= attempts


def backlog(conn: sa.Connection) -> Backlog:
    dialect = conn.dialect.name
    if dialect == "sqlite":
        age = (sa.func.julianday("now") - sa.func.julianday(sa.func.min(outbox.c.created_at))) * 86400.0
    else:
        age = sa.func.extract("epoch", sa.func.now() - sa.func.min(outbox.c.created_at))
    flagged = sa.func.count(outbox.c.flagged_at)
    most = sa.func.max(outbox.c.attempts)
    count, oldest, flagged_count, most_attempts = conn.execute(
        sa.select(sa.func.count(), age, flagged, most).where(outbox.c.state == PENDING)
    ).one()
    return Backlog(count, max(float(oldest or 0.0), 0.0), flagged_count, most_attempts or 0)


def seconds_until_due(conn: sa.Connection) -> float | None:
    """Seconds until the soonest pending unordered row becomes claimable (0 or less: one is due now),
    or None when none is pending; as far as the DUE_LOOKAHEAD_ROWS rows due first show. It can come
    out later than the truth only when all of those are leased (an after-commit sender's rows), and a
    relay never sleeps longer than its poll interval anyway."""
    value = conn.execute(until_due_statement(conn.dialect.name)).scalar()
    return None if value is None else float(value)


def until_due_statement(dialect: str) -> sa.Select:
    """`seconds_until_due`'s query. Bounded because a relay asks each time a shipping thread finds
    nothing to take: with a backlog not due yet (after a broker outage every row waits for its
    backoff) or locked by the other threads (the end of a drain), a minimum over every pending row
    was a scan of all of them, 0.2 - 1.8 s of PostgreSQL's CPU per look with 600,000 rows pending
    (docs/benchmarks.md); the soonest rows of the pending index are a few index entries."""
    soonest = (
        sa.select(outbox.c.next_attempt_at, outbox.c.lease_expires_at)
        .where(outbox.c.state == PENDING, outbox.c.order_key.is_(None))
        .order_by(outbox.c.next_attempt_at)
        .limit(DUE_LOOKAHEAD_ROWS)
        .subquery()
    )
    if dialect == "sqlite":
        lease_or_due = sa.func.coalesce(soonest.c.lease_expires_at, soonest.c.next_attempt_at)
        ready = sa.func.max(soonest.c.next_attempt_at, lease_or_due)
        wait = (sa.func.julianday(sa.func.min(ready)) - sa.func.julianday("now")) * 86400.0
    else:
        ready = sa.func.greatest(
            soonest.c.next_attempt_at, sa.func.coalesce(soonest.c.lease_expires_at, soonest.c.next_attempt_at)
        )
        wait = sa.func.extract("epoch", sa.func.min(ready) - sa.func.now())
    # Ordered rows are left out: one waiting behind an earlier row of its key is "due" and would keep a
    # relay from sleeping; the relay looks at ordered keys every poll interval and on NOTIFY.
    return sa.select(wait).select_from(soonest)
