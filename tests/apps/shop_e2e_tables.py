"""The business tables of tests/test_end_to_end.py's consumers (tests/apps/shop_e2e.py). They have no
unique key on the order, so that an effect applied twice would show as two rows instead of being
hidden by a constraint."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()
invoices = sa.Table(
    "e2e_invoices",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer, nullable=False),
)
reminders = sa.Table(
    "e2e_reminders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer, nullable=False),
)
