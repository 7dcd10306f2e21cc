"""The transactional outbox: `qmq_outbox` (see qmq/outbox/schema.py for what each column is for).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None
# The tables this revision creates: where all of them exist already (Django's migrations made them),
# `qmq db upgrade` stamps the revision instead of running it (qmq/db/migrate.py).
creates = ("qmq_outbox",)

PENDING_WHERE = sa.text("state = 'pending'")
SENT_WHERE = sa.text("state = 'sent'")


def upgrade() -> None:
    op.create_table(
        "qmq_outbox",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
        sa.Column("message_id", sa.String(64), nullable=False, unique=True),
        sa.Column("subject", sa.String(200), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("content_type", sa.String(100), nullable=False),
        sa.Column("headers", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("tags", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("key", sa.String(256), nullable=True),
        sa.Column("deliver_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("state", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("lease_token", sa.String(36), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("flagged_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("state IN ('pending', 'sent')", name="ck_qmq_outbox_state"),
    )
    op.create_index(
        "ix_qmq_outbox_pending",
        "qmq_outbox",
        ["next_attempt_at"],
        postgresql_where=PENDING_WHERE,
        sqlite_where=PENDING_WHERE,
    )
    op.create_index(
        "ix_qmq_outbox_sent_at", "qmq_outbox", ["sent_at"], postgresql_where=SENT_WHERE, sqlite_where=SENT_WHERE
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE qmq_outbox SET (fillfactor = 70)")  # HOT claims (qmq/outbox/schema.py)


def downgrade() -> None:
    op.drop_index("ix_qmq_outbox_sent_at", table_name="qmq_outbox")
    op.drop_index("ix_qmq_outbox_pending", table_name="qmq_outbox")
    op.drop_table("qmq_outbox")
