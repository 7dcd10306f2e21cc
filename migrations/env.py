"""Alembic environment for qmq's own tables.

Normally run through `qmq.db.migrate.upgrade`, which passes an open connection in
`config.attributes["connection"]`. Run by the `alembic` command instead, it connects to the
`sqlalchemy.url` main option (normalised by qmq.db.url) or `$QMQ_DB_URL`. The version table is
always qmq's own, so the host application's `alembic_version` is never read or written.
"""

from __future__ import annotations

from alembic import context

from migrations.tables import all_tables
from qmq.db.engine import create_engine
from qmq.db.migrate import QMQ_VERSION_TABLE
from qmq.db.url import resolve_url

config = context.config


def _configure_and_run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=all_tables(),
        version_table=QMQ_VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",  # ALTER TABLE on SQLite needs batch mode
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    engine = create_engine(resolve_url(config.get_main_option("sqlalchemy.url")))
    try:
        with engine.connect() as connection:
            _configure_and_run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("qmq migrations run online only: use `qmq db upgrade --db URL`")
run_migrations_online()
