"""The outbox row's `order_key` and its index (Alembic revision 0006), for an outbox table made before
ordered messages existed; a table made by 0001 since then has them already."""

from __future__ import annotations

from typing import Any

from django.db import migrations
from sqlalchemy.schema import CreateIndex

from qmq.db.ddl import dialect
from qmq.outbox.schema import outbox

INDEX = next(i for i in outbox.indexes if i.name == "ix_qmq_outbox_ordered_pending")


def add_order_key(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        columns = {c.name for c in connection.introspection.get_table_description(cursor, "qmq_outbox")}
    if "order_key" in columns:
        return
    schema_editor.execute("ALTER TABLE qmq_outbox ADD COLUMN order_key VARCHAR(256)", params=None)
    schema_editor.execute(str(CreateIndex(INDEX).compile(dialect=dialect(connection.vendor))).strip(), params=None)


class Migration(migrations.Migration):
    dependencies = [("qmq", "0002_consumed")]
    operations = [migrations.RunPython(add_order_key, migrations.RunPython.noop)]
