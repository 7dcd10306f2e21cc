"""`qmq db upgrade` as a real command on SQLite and PostgreSQL: it creates qmq's tables and its own
version table, is a no-op the second time, leaves a host application's `alembic_version` alone, and
the tables it makes are exactly qmq.meta.schema (Alembic's autogenerate finds no difference)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from migrations.tables import all_tables
from qmq.db.engine import create_engine
from qmq.db.migrate import QMQ_VERSION_TABLE, exclude_qmq_tables, head_revision
from qmq.db.url import normalize_url
from qmq.meta import schema
from tests.support.databases import sqlite_or_postgres

ROOT = Path(__file__).resolve().parents[1]
QMQ_TABLES = {"qmq_meta_group", "qmq_meta_server", "qmq_meta_route", "qmq_outbox", QMQ_VERSION_TABLE}
COMMAND_TIMEOUT_S = 120


def qmq_db(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qmq", "db", *args],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    with sqlite_or_postgres(request.param, request, tmp_path, "app.sqlite3") as url:
        yield url


def make_host_app_tables(url: str) -> None:
    """What a host application that uses Alembic already has: its tables and its `alembic_version`."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE orders (id INTEGER NOT NULL PRIMARY KEY)"))
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)"))
        conn.execute(sa.text("INSERT INTO alembic_version VALUES ('host_rev_7')"))
    engine.dispose()


def qmq_version(conn) -> list[str]:
    return conn.execute(sa.text(f"SELECT version_num FROM {QMQ_VERSION_TABLE}")).scalars().all()


def test_upgrade_creates_tables_once_and_leaves_the_host_alone(db_url) -> None:
    make_host_app_tables(db_url)
    first = qmq_db("upgrade", "--db", db_url)
    assert first.returncode == 0, first.stderr
    assert f"at revision {head_revision()}" in first.stdout

    engine = create_engine(db_url)
    try:
        tables = set(sa.inspect(engine).get_table_names())
        assert tables >= QMQ_TABLES | {"orders", "alembic_version"}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == ["host_rev_7"]
            assert qmq_version(conn) == [head_revision()]
            conn.execute(
                schema.group.insert().values(
                    name="g1", read_only=False, created_at=sa.func.now(), updated_at=sa.func.now()
                )
            )
            conn.commit()

        second = qmq_db("upgrade", "--db", db_url)
        assert second.returncode == 0, second.stderr
        assert "Running upgrade" not in second.stderr  # nothing to do
        with engine.connect() as conn:
            assert qmq_version(conn) == [head_revision()]
            assert conn.execute(sa.select(schema.group.c.name)).scalars().all() == ["g1"]  # data kept
            assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == ["host_rev_7"]
        assert set(sa.inspect(engine).get_table_names()) == tables

        current = qmq_db("current", "--db", db_url)
        assert current.returncode == 0, current.stderr
        assert f"revision {head_revision()} (up to date)" in current.stdout
    finally:
        engine.dispose()


def only_qmq_tables(obj, name, type_, reflected, compare_to) -> bool:
    """The opposite of exclude_qmq_tables: what qmq's own autogenerate would look at."""
    return not exclude_qmq_tables(obj, name, type_, reflected, compare_to)


def test_migrated_tables_match_the_schema_and_hosts_can_ignore_them(db_url) -> None:
    """Autogenerate against qmq's own metadata finds nothing to change (schema.py matches the
    revision); a host app's autogenerate with `exclude_qmq_tables` proposes nothing about qmq's tables."""
    make_host_app_tables(db_url)
    assert qmq_db("upgrade", "--db", db_url).returncode == 0
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            ours = MigrationContext.configure(
                conn, opts={"version_table": QMQ_VERSION_TABLE, "include_object": only_qmq_tables}
            )
            assert compare_metadata(ours, all_tables()) == []

            host_metadata = sa.MetaData()
            sa.Table("orders", host_metadata, sa.Column("id", sa.Integer, primary_key=True))
            host = MigrationContext.configure(conn, opts={"include_object": exclude_qmq_tables})
            assert compare_metadata(host, host_metadata) == []
            without_filter = MigrationContext.configure(conn)
            diffs = compare_metadata(without_filter, host_metadata)
            proposed = {diff[1].name for diff in diffs if diff[0] == "remove_table"}
            assert proposed >= {"qmq_meta_group", "qmq_meta_route"}  # what the filter protects against
    finally:
        engine.dispose()


def test_db_url_from_environment_and_postgres_normalisation(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'env.sqlite3'}"
    result = qmq_db("upgrade", env={**os.environ, "QMQ_DB_URL": url})
    assert result.returncode == 0, result.stderr
    assert f"revision {head_revision()}" in result.stdout
    assert normalize_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgresql+psycopg2://u@h/db") == "postgresql+psycopg2://u@h/db"
    assert normalize_url("sqlite:///x.db") == "sqlite:///x.db"
