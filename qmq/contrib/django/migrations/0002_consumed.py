"""The consumers' idempotency table `qmq_consumed`, rendered from worker/schema.py for the database's
vendor (the same table Alembic revision 0003 creates), for workers of `qmq.App(using=alias)`."""

from __future__ import annotations

from django.db import migrations

from qmq.contrib.django.tables import create_tables
from worker.schema import consumed


class Migration(migrations.Migration):
    dependencies = [("qmq", "0001_initial")]
    operations = [create_tables([consumed])]
