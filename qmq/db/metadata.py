"""The one SQLAlchemy `MetaData` holding every qmq table (meta server, outbox, ...), so that Alembic's
environment and the schema test see all of them; each table is defined in its component's
`schema.py`, which registers it here.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()


def all_tables() -> sa.MetaData:
    """`metadata` with every component's tables registered."""
    import qmq.meta.schema
    import qmq.outbox.schema  # noqa: F401
    import worker.schema  # noqa: F401

    return metadata
