"""Per-application credentials with subject ACLs, kept by the meta server (docs/security.md).

Revision ID: 0007
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "qmq_meta_credential",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("app", sa.String(200), nullable=False),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("produce", sa.Text(), nullable=False),
        sa.Column("consume", sa.Text(), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_qmq_meta_credential_app", "qmq_meta_credential", ["app"])


def downgrade() -> None:
    op.drop_index("ix_qmq_meta_credential_app", table_name="qmq_meta_credential")
    op.drop_table("qmq_meta_credential")
