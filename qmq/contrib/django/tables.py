"""qmq's tables as Django migration operations, rendered for the database's vendor from the same
SQLAlchemy definitions that Alembic's revisions are checked against (one source of truth).

A table that already exists is left alone, so `manage.py migrate` after `qmq db upgrade` works, as
`qmq db upgrade` after `manage.py migrate` does (it stamps what exists: qmq/db/migrate.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from django.db import migrations

from qmq.db.ddl import create_statements, drop_statements


def create_tables(tables: Sequence[sa.Table], postgresql_extra: Sequence[str] = ()) -> migrations.RunPython:
    """An operation creating `tables` (with their indexes) where missing, then on PostgreSQL running
    `postgresql_extra` for each table it created; reversed, it drops them."""

    def create(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        existing = set(connection.introspection.table_names())
        for table in tables:
            if table.name in existing:
                continue
            for sql in create_statements([table], connection.vendor):
                schema_editor.execute(sql, params=None)
            if connection.vendor == "postgresql":
                for sql in postgresql_extra:
                    schema_editor.execute(sql, params=None)

    def drop(apps: Any, schema_editor: Any) -> None:
        for sql in drop_statements(list(tables), schema_editor.connection.vendor):
            schema_editor.execute(sql, params=None)

    return migrations.RunPython(create, drop)
