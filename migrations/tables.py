"""Every qmq table, for Alembic's environment (env.py) and the schema tests: the components' schema
modules are imported here, each defining its tables on the shared `qmq.db.metadata.metadata`.
Only the migration tooling needs them all at once, so nothing else imports this module."""

from __future__ import annotations

import sqlalchemy as sa

import qmq.meta.credentials
import qmq.meta.schema
import qmq.outbox.schema
import worker.schema
from qmq.db.metadata import metadata

SCHEMA_MODULES = (qmq.meta.schema, qmq.meta.credentials, qmq.outbox.schema, worker.schema)


def all_tables() -> sa.MetaData:
    """The shared `MetaData`, with every component's tables on it."""
    return metadata
