"""Engines for qmq's own tables, configured the same way by every qmq server and command.

Promises: a pooled connection that died with its database (restart, failover, network cut) is
noticed before use and replaced (`pool_pre_ping`), so a server recovers by itself once the database
is back; connecting to an unreachable PostgreSQL fails within CONNECT_TIMEOUT_S instead of hanging.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qmq.db.url import normalize_url

CONNECT_TIMEOUT_S = 5  # PostgreSQL connect timeout (libpq takes whole seconds)
SQLITE_BUSY_TIMEOUT_S = 10.0  # how long a SQLite writer waits for another writer's lock


def create_engine(url: str, **kwargs: Any) -> Engine:
    """An Engine for `url` (normalised first). Extra keyword arguments go to `sqlalchemy.create_engine`."""
    url = normalize_url(url)
    backend = sa.engine.make_url(url).get_backend_name()
    connect_args: dict[str, Any] = dict(kwargs.pop("connect_args", {}))
    if backend == "postgresql":
        connect_args.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    elif backend == "sqlite":
        connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_S)
    kwargs.setdefault("pool_pre_ping", True)
    engine = sa.create_engine(url, connect_args=connect_args, **kwargs)
    if backend == "sqlite":
        fix_sqlite_transactions(engine)
    return engine


def prepare_nothing(engine: Engine) -> None:
    """PostgreSQL: the engine's connections prepare no statement (psycopg prepares one run five
    times). A named prepared statement lives on one server connection, which PgBouncer in transaction
    mode does not keep for a client: for engines of qmq's own (the relay's, the Django sender's),
    whose statements run once per batch, where a parse each costs nothing that shows."""
    if engine.dialect.name != "postgresql":
        return

    @sa.event.listens_for(engine, "connect")
    def _no_prepares(dbapi_connection: Any, connection_record: Any) -> None:
        dbapi_connection.prepare_threshold = None


def fix_sqlite_transactions(engine: Engine) -> None:
    """Let SQLAlchemy, not the sqlite3 module, begin SQLite transactions, and begin them IMMEDIATE.

    Without it a savepoint taken before the first write starts a transaction that RELEASE commits (a
    rolled-back savepoint's rows, and messages, could survive), and a transaction that read before it
    wrote fails at once with "database is locked" when another connection (the outbox sender) wrote
    meanwhile: SQLite cannot upgrade its read lock, and no busy timeout helps. IMMEDIATE takes the
    write lock at BEGIN, so writers queue for it instead. SQLAlchemy's documented recipe, with
    IMMEDIATE; apply it to an application's own SQLite engine (Flask-SQLAlchemy's `db.engine`)."""

    @sa.event.listens_for(engine, "connect")
    def _autocommit_driver(dbapi_connection: Any, connection_record: Any) -> None:
        dbapi_connection.isolation_level = None

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def safe_url(engine: Engine) -> str:
    """The engine's URL for logs and messages, password hidden."""
    return engine.url.render_as_string(hide_password=True)
