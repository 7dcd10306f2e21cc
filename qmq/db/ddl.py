"""qmq's tables as SQL DDL for one database kind, rendered from the same SQLAlchemy definitions the
Alembic migrations are checked against: one source of truth for projects that migrate with Django."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable, DropTable

DIALECTS = {"postgresql": postgresql.dialect(), "sqlite": sqlite.dialect()}


def dialect(name: str) -> sa.Dialect:
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(f"qmq's tables support PostgreSQL and SQLite, not {name}") from None


def create_statements(tables: list[sa.Table], dialect_name: str) -> list[str]:
    """CREATE TABLE and CREATE INDEX statements for `tables`, in order."""
    d = dialect(dialect_name)
    statements = []
    for table in tables:
        statements.append(str(CreateTable(table).compile(dialect=d)).strip())
        statements += [
            str(CreateIndex(index).compile(dialect=d)).strip()
            for index in sorted(table.indexes, key=lambda i: i.name or "")
        ]
    return statements


def drop_statements(tables: list[sa.Table], dialect_name: str) -> list[str]:
    d = dialect(dialect_name)
    return [str(DropTable(table).compile(dialect=d)).strip() for table in reversed(tables)]
