"""The address a server advertises to clients outside its network (`--advertise-external`), handed
out by the meta server's external listener (docs/meta.md, "Two listeners").

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("qmq_meta_server", sa.Column("external_address", sa.String(300), nullable=True))


def downgrade() -> None:
    op.drop_column("qmq_meta_server", "external_address")
