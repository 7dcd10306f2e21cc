"""Replicated groups: each group's epoch and master, what each replicating server last reported, and
the lease that lets one meta server at a time decide failovers (docs/replication.md).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "qmq_meta_replication",
        sa.Column("group_name", sa.String(200), primary_key=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("master", sa.String(300), nullable=False),
        sa.Column("in_sync", sa.Text(), nullable=False, server_default=""),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "qmq_meta_replica",
        sa.Column("address", sa.String(300), primary_key=True),
        sa.Column("group_name", sa.String(200), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("log_end", sa.BigInteger(), nullable=False),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_qmq_meta_replica_group_name", "qmq_meta_replica", ["group_name"])
    op.create_table(
        "qmq_meta_lease",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("holder", sa.String(300), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.execute("INSERT INTO qmq_meta_lease (name) VALUES ('failover')")


def downgrade() -> None:
    op.drop_table("qmq_meta_lease")
    op.drop_index("ix_qmq_meta_replica_group_name", table_name="qmq_meta_replica")
    op.drop_table("qmq_meta_replica")
    op.drop_table("qmq_meta_replication")
