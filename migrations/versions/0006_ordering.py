"""Ordered messages (docs/ordering.md): the outbox row's `order_key` with the index of a key's pending
rows, and the meta server's record of which broker group holds each logical queue of an ordered
subject (`qmq_meta_queue`), so that a group joining a route never moves a key silently.

Revision ID: 0006
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

ORDERED_PENDING_WHERE = sa.text("state = 'pending' AND order_key IS NOT NULL")


def upgrade() -> None:
    # An outbox table made by Django's migrations from the current definition has them already.
    inspector = sa.inspect(op.get_bind())
    if "order_key" not in {c["name"] for c in inspector.get_columns("qmq_outbox")}:
        op.add_column("qmq_outbox", sa.Column("order_key", sa.String(256), nullable=True))
    if "ix_qmq_outbox_ordered_pending" not in {i["name"] for i in inspector.get_indexes("qmq_outbox")}:
        op.create_index(
            "ix_qmq_outbox_ordered_pending",
            "qmq_outbox",
            ["subject", "order_key", "id"],
            postgresql_where=ORDERED_PENDING_WHERE,
            sqlite_where=ORDERED_PENDING_WHERE,
        )
    op.create_table(
        "qmq_meta_queue",
        sa.Column("subject", sa.String(200), primary_key=True),
        sa.Column("queue", sa.Integer(), primary_key=True),
        sa.Column("group_name", sa.String(200), sa.ForeignKey("qmq_meta_group.name"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("qmq_meta_queue")
    op.drop_index("ix_qmq_outbox_ordered_pending", table_name="qmq_outbox")
    op.drop_column("qmq_outbox", "order_key")
