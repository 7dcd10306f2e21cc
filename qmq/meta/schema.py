"""The meta server's tables as SQLAlchemy Core objects. They must match the Alembic revisions in
migrations/versions/ (tests/test_migrations.py compares them); change both together.

Every timestamp is written by the meta server from its own clock, in UTC. SQLite hands them back
without a zone: `as_utc` puts it back.
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa

from qmq.db.metadata import metadata  # shared by every qmq table

NAME_LEN = 200  # group names and subjects (the same as qmq.protocol.limits.MAX_SUBJECT_LEN)
ADDRESS_LEN = 300  # "host:port"
KINDS = ("broker", "delay")


group = sa.Table(
    "qmq_meta_group",
    metadata,
    sa.Column("name", sa.String(NAME_LEN), primary_key=True),
    sa.Column("read_only", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

server = sa.Table(
    "qmq_meta_server",
    metadata,
    sa.Column("address", sa.String(ADDRESS_LEN), primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("group_name", sa.String(NAME_LEN), sa.ForeignKey("qmq_meta_group.name"), nullable=True),
    sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
    # Set by a clean shutdown (META_UNREGISTER): unavailable at once; cleared by the next heartbeat.
    sa.Column("unregistered_at", sa.DateTime(timezone=True), nullable=True),
    # The address for clients outside the servers' network (the meta server's external listener,
    # docs/meta.md); NULL: the same as `address`.
    sa.Column("external_address", sa.String(ADDRESS_LEN), nullable=True),
    sa.CheckConstraint("kind IN ('broker', 'delay')", name="ck_qmq_meta_server_kind"),
)
sa.Index("ix_qmq_meta_server_group_name", server.c.group_name)

route = sa.Table(
    "qmq_meta_route",
    metadata,
    sa.Column("subject", sa.String(NAME_LEN), primary_key=True),
    sa.Column("group_name", sa.String(NAME_LEN), sa.ForeignKey("qmq_meta_group.name"), primary_key=True),
    # The order groups were given to the subject in (0, 1, ...): replies list them in this order.
    sa.Column("position", sa.Integer(), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)
sa.Index("ix_qmq_meta_route_group_name", route.c.group_name)


def as_utc(value: datetime) -> datetime:
    """`value` as an aware UTC datetime (SQLite returns naive ones, which qmq always wrote in UTC)."""
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


# -- replication (docs/replication.md) ---------------------------------------------------------------

# One row per replicated group (broker groups, and delay-server groups as "delay:<name>"): its epoch and
# master, and which replicas the master last said were in sync (comma-separated addresses).
replication = sa.Table(
    "qmq_meta_replication",
    metadata,
    sa.Column("group_name", sa.String(NAME_LEN), primary_key=True),
    sa.Column("epoch", sa.Integer(), nullable=False),
    sa.Column("master", sa.String(ADDRESS_LEN), nullable=False),
    sa.Column("in_sync", sa.Text(), nullable=False, server_default=""),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)

# What each replicating server last reported: its role, epoch and message-log end.
replica = sa.Table(
    "qmq_meta_replica",
    metadata,
    sa.Column("address", sa.String(ADDRESS_LEN), primary_key=True),
    sa.Column("group_name", sa.String(NAME_LEN), nullable=False),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("epoch", sa.Integer(), nullable=False),
    sa.Column("log_end", sa.BigInteger(), nullable=False),
    sa.Column("reported_at", sa.DateTime(timezone=True), nullable=False),
    # In its last report, this replica could not reach its master (election.py: an earlier failover)
    sa.Column("master_lost", sa.Boolean(), nullable=False, server_default=sa.false()),
)
sa.Index("ix_qmq_meta_replica_group_name", replica.c.group_name)

# Leases among the meta servers sharing a database: the holder of "failover" decides failovers.
lease = sa.Table(
    "qmq_meta_lease",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("holder", sa.String(ADDRESS_LEN), nullable=True),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
)

# Ordered subjects (docs/ordering.md): the broker group of each logical queue, chosen once, when the
# subject's first ordered message or consumer asked, and never changed by a route change.
queue = sa.Table(
    "qmq_meta_queue",
    metadata,
    sa.Column("subject", sa.String(NAME_LEN), primary_key=True),
    sa.Column("queue", sa.Integer(), primary_key=True),
    sa.Column("group_name", sa.String(NAME_LEN), sa.ForeignKey("qmq_meta_group.name"), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)
