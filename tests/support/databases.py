"""Throw-away PostgreSQL databases for tests that need one of their own (a fresh schema, or a database
the test takes away and brings back), next to the session's `pg_url` database."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg


def _admin_url(pg_url: str) -> str:
    return pg_url.rsplit("/", 1)[0] + "/postgres"


@contextlib.contextmanager
def fresh_database(pg_url: str) -> Iterator[str]:
    """Create an empty database on the server of `pg_url`; yield its URL; drop it afterwards."""
    name = f"{pg_url.rsplit('/', 1)[1]}_{uuid.uuid4().hex[:8]}"
    admin = _admin_url(pg_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def sqlite_or_postgres(kind: str, request, tmp_path, name: str) -> Iterator[str]:
    """The URL of an empty database of `kind` ("sqlite" or "postgresql") for one test; for fixtures
    parametrized over both."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / name}"
    else:
        with fresh_database(request.getfixturevalue("pg_url")) as url:
            yield url


@contextlib.contextmanager
def migrated_engine(kind: str, request, tmp_path, name: str) -> Iterator[Any]:
    """An engine on a fresh database (as `sqlite_or_postgres`) holding qmq's tables; disposed after."""
    from qmq.db.engine import create_engine
    from qmq.db.migrate import upgrade

    with sqlite_or_postgres(kind, request, tmp_path, name) as url:
        upgrade(url)
        engine = create_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


def set_connections_allowed(url: str, allowed: bool) -> None:
    """Take the database of `url` away (no new connections, the open ones killed) or bring it back:
    to its clients this looks like a database server that went down and came back up."""
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(_admin_url(url), autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if allowed else "false"}')
        if not allowed:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
