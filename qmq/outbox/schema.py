"""The outbox table, `qmq_outbox`: one row per message a transaction sent. It must match the Alembic
revision migrations/versions/0002_outbox.py (tests/test_migrations.py compares them).

A row is inserted in the application's transaction (state `pending`), claimed by a sender or relay
with a lease (`lease_token`, `lease_expires_at`), and marked `sent` under that lease once a broker
stored it. Sent rows stay for the audit window (the nightly reconciliation reads them) and are then
purged. Times that order work (`created_at`, leases, next attempts) come from the database clock.
"""

from __future__ import annotations

import sqlalchemy as sa

from qmq.db.metadata import metadata
from qmq.protocol.limits import MAX_KEY_LEN, MAX_MESSAGE_ID_LEN, MAX_SUBJECT_LEN

PENDING = "pending"
SENT = "sent"
STATES = (PENDING, SENT)
LEASE_TOKEN_LEN = 36  # a UUID
CONTENT_TYPE_LEN = 100

outbox = sa.Table(
    "qmq_outbox",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("message_id", sa.String(MAX_MESSAGE_ID_LEN), nullable=False, unique=True),
    sa.Column("subject", sa.String(MAX_SUBJECT_LEN), nullable=False),
    sa.Column("body", sa.LargeBinary(), nullable=False),  # the envelope's body bytes
    sa.Column("content_type", sa.String(CONTENT_TYPE_LEN), nullable=False),
    sa.Column("headers", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("tags", sa.JSON(none_as_null=True), nullable=True),
    sa.Column("key", sa.String(MAX_KEY_LEN), nullable=True),
    # Ordered messages (docs/ordering.md): rows of one (subject, order_key) ship in `id` order.
    sa.Column("order_key", sa.String(MAX_KEY_LEN), nullable=True),
    sa.Column("deliver_at", sa.DateTime(timezone=True), nullable=True),  # a delayed message
    sa.Column("state", sa.String(16), nullable=False, server_default=PENDING),
    sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("lease_token", sa.String(LEASE_TOKEN_LEN), nullable=True),
    sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    sa.Column("flagged_at", sa.DateTime(timezone=True), nullable=True),  # pending too long: an operator should look
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.CheckConstraint(f"state IN ('{PENDING}', '{SENT}')", name="ck_qmq_outbox_state"),
)

PENDING_WHERE = sa.text(f"state = '{PENDING}'")
SENT_WHERE = sa.text(f"state = '{SENT}'")
# The relay's claim query: pending rows due now, oldest first. Partial: sent rows (the great majority
# in a healthy system) are not in it, so it stays small and hot.
sa.Index("ix_qmq_outbox_pending", outbox.c.next_attempt_at, postgresql_where=PENDING_WHERE, sqlite_where=PENDING_WHERE)
# Ordered shipping: a key's pending rows in outbox order (`id`), and the heads of every blocked key.
ORDERED_PENDING_WHERE = sa.text(f"state = '{PENDING}' AND order_key IS NOT NULL")
sa.Index(
    "ix_qmq_outbox_ordered_pending",
    outbox.c.subject,
    outbox.c.order_key,
    outbox.c.id,
    postgresql_where=ORDERED_PENDING_WHERE,
    sqlite_where=ORDERED_PENDING_WHERE,
)
# The purge of sent rows past the audit window.
sa.Index("ix_qmq_outbox_sent_at", outbox.c.sent_at, postgresql_where=SENT_WHERE, sqlite_where=SENT_WHERE)
# No index on created_at: the nightly reconciliation reads a window by ranges of `id` (the primary
# key), and every index costs each insert and update of the application and the relay.

# PostgreSQL: room on each page, so that a claim (which changes no indexed column) is a HOT update and
# writes no index entries. Applied by migration 0002 and by qmq.db.ddl (Django).
PG_STORAGE_PARAMETERS = "ALTER TABLE qmq_outbox SET (fillfactor = 70)"
