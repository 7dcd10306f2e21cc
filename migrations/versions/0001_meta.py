"""The meta server's tables: broker groups, registered servers and subject routes.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None
# The tables this revision creates: where all of them exist already (Django's migrations made them),
# `qmq db upgrade` stamps the revision instead of running it (qmq/db/migrate.py).
creates = ("qmq_meta_group", "qmq_meta_server", "qmq_meta_route")


def upgrade() -> None:
    op.create_table(
        "qmq_meta_group",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("read_only", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "qmq_meta_server",
        sa.Column("address", sa.String(300), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("group_name", sa.String(200), sa.ForeignKey("qmq_meta_group.name"), nullable=True),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("unregistered_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("kind IN ('broker', 'delay')", name="ck_qmq_meta_server_kind"),
    )
    op.create_index("ix_qmq_meta_server_group_name", "qmq_meta_server", ["group_name"])
    op.create_table(
        "qmq_meta_route",
        sa.Column("subject", sa.String(200), primary_key=True),
        sa.Column("group_name", sa.String(200), sa.ForeignKey("qmq_meta_group.name"), primary_key=True),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_qmq_meta_route_group_name", "qmq_meta_route", ["group_name"])


def downgrade() -> None:
    op.drop_index("ix_qmq_meta_route_group_name", table_name="qmq_meta_route")
    op.drop_table("qmq_meta_route")
    op.drop_index("ix_qmq_meta_server_group_name", table_name="qmq_meta_server")
    op.drop_table("qmq_meta_server")
    op.drop_table("qmq_meta_group")
