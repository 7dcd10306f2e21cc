"""The one SQLAlchemy `MetaData` that every qmq table is defined on. Each component defines its own
tables in its `schema.py` (qmq/meta, qmq/outbox, worker) on this object; `migrations/tables.py`
gathers all of them for Alembic and the schema tests. This module imports none of them.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()
