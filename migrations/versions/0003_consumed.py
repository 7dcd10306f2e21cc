"""The consumers' idempotency records: `qmq_consumed` (see worker/schema.py for what each column is for).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None
# The tables this revision creates: where all of them exist already (Django's migrations made them),
# `qmq db upgrade` stamps the revision instead of running it (qmq/db/migrate.py).
creates = ("qmq_consumed",)


def upgrade() -> None:
    op.create_table(
        "qmq_consumed",
        sa.Column("consumer_group", sa.String(200), primary_key=True),
        sa.Column("message_id", sa.String(64), primary_key=True),
        sa.Column("subject", sa.String(200), nullable=False),
        sa.Column("consumed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("ix_qmq_consumed_consumed_at", "qmq_consumed", ["consumed_at"])


def downgrade() -> None:
    op.drop_index("ix_qmq_consumed_consumed_at", table_name="qmq_consumed")
    op.drop_table("qmq_consumed")
