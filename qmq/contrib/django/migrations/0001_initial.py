"""The outbox table, rendered from qmq/outbox/schema.py for the database's vendor (the same table
Alembic revision 0002 creates)."""

from __future__ import annotations

from django.db import migrations

from qmq.contrib.django.tables import create_tables
from qmq.outbox.schema import PG_STORAGE_PARAMETERS, outbox


class Migration(migrations.Migration):
    initial = True
    dependencies: list = []
    operations = [create_tables([outbox], [PG_STORAGE_PARAMETERS])]
