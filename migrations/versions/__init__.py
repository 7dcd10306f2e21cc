"""qmq's revisions, one lineage, recorded in the `qmq_alembic_version` table."""
