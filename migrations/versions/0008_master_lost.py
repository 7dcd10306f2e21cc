"""Replicas report whether they can reach their master, so that a master every in-sync replica has
lost (a crashed process: its connections close at once) is replaced one heartbeat interval sooner,
and a failover counted from the crash stays under --failover-after (docs/replication.md).

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("qmq_meta_replica", sa.Column("master_lost", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    op.drop_column("qmq_meta_replica", "master_lost")
