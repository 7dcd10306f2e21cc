"""The idempotency table, `qmq_consumed`: one row per (consumer group, message id) whose handler
committed. It must match migrations/versions/0003_consumed.py (tests/test_migrations.py compares them).

A row is inserted in the handler's own transaction (worker/steps/idempotency.py), so it exists exactly when
the handler's writes do; the primary key is what makes a second delivery find it. `consumed_at` is
the database clock; rows older than the idempotency window are purged. The nightly reconciliation
joins `message_id` with the outbox and the broker ledger.
"""

from __future__ import annotations

import sqlalchemy as sa

from qmq.db.metadata import metadata
from qmq.protocol.limits import MAX_MESSAGE_ID_LEN, MAX_SUBJECT_LEN

GROUP_LEN = 200  # consumer group names (the client's limit)

consumed = sa.Table(
    "qmq_consumed",
    metadata,
    sa.Column("consumer_group", sa.String(GROUP_LEN), primary_key=True),
    sa.Column("message_id", sa.String(MAX_MESSAGE_ID_LEN), primary_key=True),
    sa.Column("subject", sa.String(MAX_SUBJECT_LEN), nullable=False),
    sa.Column("consumed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
)

# The purge of rows past the idempotency window, and the reconciliation's window scan.
sa.Index("ix_qmq_consumed_consumed_at", consumed.c.consumed_at)
