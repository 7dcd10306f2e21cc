"""The outbox table, rendered from qmq/outbox/schema.py for the database's vendor (the same table
Alembic revision 0002 creates)."""

from __future__ import annotations

from django.db import migrations

from qmq.db.ddl import create_statements, drop_statements
from qmq.outbox.schema import PG_STORAGE_PARAMETERS, outbox


def create(apps, schema_editor) -> None:
    vendor = schema_editor.connection.vendor
    for sql in create_statements([outbox], vendor):
        schema_editor.execute(sql, params=None)
    if vendor == "postgresql":
        schema_editor.execute(PG_STORAGE_PARAMETERS, params=None)


def drop(apps, schema_editor) -> None:
    for sql in drop_statements([outbox], schema_editor.connection.vendor):
        schema_editor.execute(sql, params=None)


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []
    operations = [migrations.RunPython(create, drop)]
