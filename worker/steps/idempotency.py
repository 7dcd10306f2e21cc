"""The idempotency step: a message's effect happens once per consumer group, however often it is
delivered.

SQL (`idempotent=True`): a row `(consumer group, message id)` is inserted into `qmq_consumed` in
the message's transaction (worker/database.py), the one of the handler's writes, before the handler
runs. A delivery that finds the row already there skips the handler and is acknowledged.
Exactly once, for effects in that database: the row and the writes commit together or not at all,
and a second delivery running at the same moment waits on the first one's row lock (PostgreSQL)
or database lock (SQLite) and then sees it. Rows older than the app's idempotency window are purged
by the worker (`purge_consumed`); the window must be longer than a message can take to come back
(the broker keeps messages 72 h).

Redis (`idempotent="redis"`), for effects outside the database: before the handler, SET NX of a
"running" lease key with an expiry; after success the key says "done" for the idempotency window;
after a failure it is deleted so the retry runs. A delivery that finds "done" is skipped and acked;
one that finds a "running" lease is retried after the lease runs out (the first delivery may still
be at work, or its worker died). Weaker promise: the effect and the "done" mark are not atomic, so a
worker that dies between them repeats the effect once; Redis losing the key (a failover before
replication, eviction under memory pressure) lets a duplicate through. Never a lost message.
"""

from __future__ import annotations

import logging
import secrets
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from worker.outcome import DUPLICATE, Kind, Outcome
from worker.schema import consumed
from worker.steps.step import Call, Next

log = logging.getLogger("qmq.worker")

DEFAULT_WINDOW = timedelta(days=7)
PURGE_BATCH = 5000  # rows deleted per statement, so a purge never holds a long lock
DEFAULT_LEASE_S = 300.0  # Redis "running" lease for a consumer without a time limit
LEASE_MARGIN_S = 30.0  # added to a time limit: the lease outlives the handler's own limit
REDIS_DONE = b"done"
# Delete the lease only if it is still ours (it may have expired and been taken by another worker).
REDIS_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def sql_idempotency_step(call: Call, call_next: Next) -> Outcome:
    """Inside the transaction step: the record goes in with the handler's writes."""
    if call.consumer.idempotent is not True:
        return call_next(call)
    transaction = call.transaction
    assert transaction is not None, "the transaction step opens the transaction first"
    group, message = call.consumer.group, call.message
    if transaction.connection is not None:
        recorded = record_consumed(transaction.connection, group, message.id, message.subject)
    else:  # a Django transaction: its cursor takes %s on every database
        with transaction.cursor() as cursor:
            cursor.execute(INSERT_IGNORING_DUPLICATES.format("%s"), (group, message.id, message.subject))
            recorded = cursor.fetchone() is not None
    return call_next(call) if recorded else DUPLICATE


def redis_idempotency_step(call: Call, call_next: Next) -> Outcome:
    """Outside the transaction step: "done" is marked only after the handler's transaction committed."""
    if call.consumer.idempotent != "redis":
        return call_next(call)
    return _redis(call, call_next)


# PostgreSQL and SQLite (3.35+) both speak this. It runs on the DB-API cursor of the transaction's
# connection: SQLAlchemy's statement execution costs more than the round trip itself, and the worker
# makes one per message (SQLAlchemy's dialect insert().on_conflict_do_nothing() is even compiled
# anew each time).
INSERT_IGNORING_DUPLICATES = (
    f"INSERT INTO {consumed.name} (consumer_group, message_id, subject) "
    "VALUES ({0}, {0}, {0}) ON CONFLICT DO NOTHING RETURNING message_id"
)
ON_CONFLICT_DIALECTS = frozenset({"postgresql", "sqlite"})
PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}  # DB-API paramstyles with positional markers


def record_consumed(connection: Connection, group: str, message_id: str, subject: str) -> bool:
    """Insert the idempotency row in the connection's transaction; False if it was there already."""
    dialect = connection.dialect
    if dialect.name in ON_CONFLICT_DIALECTS and dialect.paramstyle in PLACEHOLDERS:
        cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute(
                INSERT_IGNORING_DUPLICATES.format(PLACEHOLDERS[dialect.paramstyle]), (group, message_id, subject)
            )
            return cursor.fetchone() is not None
        finally:
            cursor.close()
    try:  # any other database: a savepoint around a plain insert
        with connection.begin_nested():
            connection.execute(consumed.insert().values(consumer_group=group, message_id=message_id, subject=subject))
        return True
    except IntegrityError:
        return False


def purge_consumed(engine: Engine, window: timedelta, batch: int = PURGE_BATCH) -> int:
    """Delete idempotency rows older than `window`, `batch` at a time, each batch its own
    transaction; returns how many went."""
    cutoff = datetime.now(UTC) - window
    key = sa.tuple_(consumed.c.consumer_group, consumed.c.message_id)
    total = 0
    while True:
        victims = (
            sa.select(consumed.c.consumer_group, consumed.c.message_id)
            .where(consumed.c.consumed_at < cutoff)
            .limit(batch)
        )
        with engine.begin() as connection:
            deleted = connection.execute(consumed.delete().where(key.in_(victims))).rowcount
        total += deleted
        if deleted < batch:
            return total


def _redis(call: Call, call_next: Next) -> Outcome:
    consumer = call.consumer
    client = consumer.app.redis
    key = f"{consumer.app.redis_prefix}consumed:{consumer.group}:{call.message.id}"
    lease_s = consumer.time_limit + LEASE_MARGIN_S if consumer.time_limit else DEFAULT_LEASE_S
    token = f"running:{secrets.token_hex(8)}".encode()
    if not client.set(key, token, nx=True, px=int(lease_s * 1000)):
        state = client.get(key)
        if state == REDIS_DONE:
            return DUPLICATE
        if state is not None:  # another delivery holds the lease, or held it and died
            remaining_ms = max(0, client.pttl(key))
            return Outcome(Kind.RETRY, delay_s=remaining_ms / 1000 + 1, reason="another delivery holds the lease")
        return _redis(call, call_next)  # the lease expired between SET and GET
    try:
        outcome = call_next(call)
    except BaseException:
        client.eval(REDIS_RELEASE, 1, key, token)
        raise
    if outcome.kind is Kind.ACK:
        client.set(key, REDIS_DONE, px=int(consumer.app.idempotency_window.total_seconds() * 1000))
    else:
        client.eval(REDIS_RELEASE, 1, key, token)
    return outcome
