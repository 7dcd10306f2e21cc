"""Masters and epochs of replicated groups, and automatic failover (docs/replication.md). No
sockets: `qmq.meta.server` calls `report` for each heartbeat that carries a role and `sweep` on its
liveness loop.

- The first server of a group to report becomes its master, with epoch 1.
- A master reports which replicas are in sync; only those may be promoted.
- When the master has not reported for `failover_after_s`, the live replica that was in sync with
  the highest message-log end becomes master with the next epoch. The bump is a compare-and-set
  (`epoch = epoch + 1 WHERE epoch = seen`), and only the meta server holding the `failover` lease
  decides at a time, so several meta servers on one database never promote two masters.
- When every live in-sync replica also said, after the master's last report, that it cannot reach
  the master (a crashed process: its connections close at once), one heartbeat interval less is
  enough: the master's last report may be up to an interval old when it dies, so a failover counted
  from the crash stays under `failover_after_s`. A master cut off from the meta server fences itself
  after half of `failover_after_s` (qmq/replication/roles.py), before either rule can promote another.
- A master that reports a log shorter than an in-sync replica's (it came back with a wiped disk) is
  replaced the same way at once: it would otherwise hand out a log that lost acknowledged messages.
  A master still serving its epoch is not judged so: its report may be older than the replica's.
- A member gone for good (its machine lost) is forgotten by hand (`forget_member`, `qmq admin group
  forget`): never the master, and not one that reported lately unless forced.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qmq.meta import schema
from qmq.meta.registry import HEARTBEAT_INTERVAL_S
from qmq.meta.schema import as_utc

log = logging.getLogger("qmq.meta")

FAILOVER_AFTER_S = 10.0  # a master silent this long is replaced by an in-sync replica
HEARTBEATS_PER_FAILOVER = 4  # replicating servers heartbeat this often within failover_after
CANDIDATE_HEARTBEATS = 2  # a replica is promoted only if heard from within this many heartbeat intervals
LEASE_NAME = "failover"
WRITE_ATTEMPTS = 3


def heartbeat_interval_s(failover_after_s: float) -> float:
    """How often the servers of a replicated group are asked to heartbeat."""
    return min(HEARTBEAT_INTERVAL_S, failover_after_s / HEARTBEATS_PER_FAILOVER)


@dataclass(frozen=True)
class Assignment:
    """What the meta server tells a replicating server: its group's epoch and master."""

    group: str
    epoch: int
    master: str
    members: int = 0  # the other servers of the group that ever reported
    peers: tuple[str, ...] = ()  # their addresses (a master drops the replicas no longer listed)

    def role_of(self, address: str) -> str:
        return "master" if address == self.master else "replica"


class ForgetRefused(Exception):
    """A member may not be forgotten: unknown, the master, or alive (without force). The message
    says why and what to do instead."""


@dataclass(frozen=True)
class Forgotten:
    """A member removed from its group: what is left of the group."""

    group: str
    address: str
    epoch: int
    master: str
    replicas: tuple[str, ...]  # the members left besides the master
    silent_s: float  # how long the member had not reported


@dataclass(frozen=True)
class Failover:
    group: str
    epoch: int
    master: str
    old_master: str
    log_end: int
    reason: str


@dataclass(frozen=True)
class Reported:
    """What one heartbeat of a replicating server said."""

    address: str
    group: str
    role: str
    epoch: int
    log_end: int
    master_lost: bool  # a replica that cannot reach its master


class Election:
    def __init__(
        self,
        engine: Engine,
        *,
        failover_after_s: float = FAILOVER_AFTER_S,
        clock: Callable[[], datetime],
        holder: str | None = None,
    ) -> None:
        if failover_after_s <= 0:
            raise ValueError("failover_after_s must be positive")
        self.engine = engine
        self.failover_after = timedelta(seconds=failover_after_s)
        # A master every in-sync replica has lost is replaced one heartbeat interval sooner.
        self.failover_after_lost = self.failover_after - timedelta(seconds=heartbeat_interval_s(failover_after_s))
        # A replica is promoted only if it reported lately: one frozen or cut off together with the
        # master reported about as long ago as the master did, so within `failover_after` it would
        # still pass for live, be promoted and leave the group without a master.
        self.candidate_within = timedelta(seconds=CANDIDATE_HEARTBEATS * heartbeat_interval_s(failover_after_s))
        self.lease_for = timedelta(seconds=max(1.0, failover_after_s / 2))
        self.clock = clock
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stuck: set[str] = set()  # groups whose master is gone with no replica to promote (logged once)

    # -- heartbeats -------------------------------------------------------------------------------

    def report(
        self,
        address: str,
        group: str,
        role: str,
        epoch: int,
        log_end: int,
        in_sync: list[str] | None,
        master_lost: bool = False,
    ) -> Assignment:
        """Record a replicating server's heartbeat; its group's epoch and master. A master's
        `in_sync` list (for its own epoch) is kept for the next failover; a replica's `master_lost`
        (it cannot reach its master) can make that failover sooner."""
        now = self.clock()
        reported = Reported(address, group, role, epoch, log_end, master_lost)
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with self.engine.begin() as conn:
                    return self._report(conn, now, reported, in_sync)
            except sa.exc.IntegrityError:  # another meta server inserted the same row first
                if attempt == WRITE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _report(self, conn: Connection, now: datetime, reported: Reported, in_sync: list[str] | None) -> Assignment:
        address, group, role = reported.address, reported.group, reported.role
        values = {
            "group_name": group,
            "role": role,
            "epoch": reported.epoch,
            "log_end": reported.log_end,
            "reported_at": now,
            "master_lost": reported.master_lost,
        }
        updated = conn.execute(schema.replica.update().where(schema.replica.c.address == address).values(**values))
        if updated.rowcount == 0:
            conn.execute(schema.replica.insert().values(address=address, **values))
        row = conn.execute(sa.select(schema.replication).where(schema.replication.c.group_name == group)).first()
        if row is None:
            conn.execute(
                schema.replication.insert().values(
                    group_name=group, epoch=1, master=address, in_sync=",".join(sorted(in_sync or ())), updated_at=now
                )
            )
            log.info("group %s: %s is master, epoch 1 (first to register)", group, address)
            peers = self._peers(conn, group, address)
            return Assignment(group, 1, address, len(peers), peers)
        if row.master == address and role != "master":
            row = self._replace_if_log_lost(conn, now, row, reported.log_end)
        if row.master == address and role == "master" and reported.epoch == row.epoch and in_sync is not None:
            listed = ",".join(sorted(in_sync))
            if listed != row.in_sync:
                conn.execute(
                    schema.replication.update()
                    .where(schema.replication.c.group_name == group, schema.replication.c.epoch == row.epoch)
                    .values(in_sync=listed, updated_at=now)
                )
        peers = self._peers(conn, group, address)
        return Assignment(group, row.epoch, row.master, len(peers), peers)

    def _replace_if_log_lost(self, conn: Connection, now: datetime, row, log_end: int):
        """The master on record reports before it serves (it restarted): if a live in-sync replica
        has more of the log (its disk was wiped, or a crash lost its page cache), promote that
        replica now, before this answer could make the short log master and its next report empty
        the in-sync list. Returns the group's row as it is now."""
        best = self._best_in_sync(conn, now, row)
        if best is None or best.log_end <= log_end:
            return row
        reason = f"the master came back with log end {log_end}, an in-sync replica has {best.log_end}"
        failover = self._promote(conn, now, row, reason)
        if failover is None:
            return row
        log.warning(
            "group %s: failover to %s, epoch %d (log end %d): %s (old master %s)",
            failover.group,
            failover.master,
            failover.epoch,
            failover.log_end,
            failover.reason,
            failover.old_master,
        )
        return conn.execute(
            sa.select(schema.replication).where(schema.replication.c.group_name == row.group_name)
        ).one()

    def _peers(self, conn: Connection, group: str, address: str) -> tuple[str, ...]:
        """The other members of `group` (every server that reported and was not forgotten)."""
        rows = conn.execute(
            sa.select(schema.replica.c.address)
            .where(schema.replica.c.group_name == group, schema.replica.c.address != address)
            .order_by(schema.replica.c.address)
        )
        return tuple(r.address for r in rows)

    def forget(self, address: str) -> None:
        """A server left cleanly: it no longer counts as a member of its group."""
        with self.engine.begin() as conn:
            conn.execute(schema.replica.delete().where(schema.replica.c.address == address))

    def forget_member(self, group: str, address: str, *, force: bool = False) -> Forgotten:
        """Remove a member gone for good from `group`: it no longer counts towards the group's
        replicas (nor the default acknowledgement rule) and can never be promoted. Refused for the
        master, and for a member that reported within `failover_after` unless `force` (a live
        member comes back at its next heartbeat anyway). Raises ForgetRefused."""
        now = self.clock()
        with self.engine.begin() as conn:
            row = conn.execute(
                sa.select(schema.replication).where(schema.replication.c.group_name == group).with_for_update()
            ).first()
            if row is None:
                raise ForgetRefused(f"group {group!r} is not a replicated group the meta server knows")
            member = conn.execute(sa.select(schema.replica).where(schema.replica.c.address == address)).first()
            if member is None or member.group_name != group:
                members = ", ".join((row.master, *self._peers(conn, group, row.master))) or "none"
                raise ForgetRefused(f"{address} is not a member of group {group} (members: {members})")
            if row.master == address:
                raise ForgetRefused(
                    f"{address} is the master of group {group} (epoch {row.epoch}): a master is never forgotten; "
                    f"switch it first (qmq admin failover --group {group}) or let the failover replace it"
                )
            silent = now - as_utc(member.reported_at)
            if silent <= self.failover_after and not force:
                raise ForgetRefused(
                    f"{address} reported {silent.total_seconds():.1f} s ago (within --failover-after "
                    f"{self.failover_after.total_seconds():g} s): it looks alive; stop it first, or give --force"
                )
            conn.execute(schema.replica.delete().where(schema.replica.c.address == address))
            in_sync = [a for a in filter(None, row.in_sync.split(",")) if a != address]
            conn.execute(
                schema.replication.update()
                .where(schema.replication.c.group_name == group)
                .values(in_sync=",".join(in_sync), updated_at=now)
            )
            replicas = self._peers(conn, group, row.master)
        log.warning(
            "group %s: member %s forgotten (silent %.1f s); master %s, epoch %d, replicas left: %s",
            group,
            address,
            silent.total_seconds(),
            row.master,
            row.epoch,
            ", ".join(replicas) or "none",
        )
        return Forgotten(group, address, row.epoch, row.master, replicas, silent.total_seconds())

    # -- failover ---------------------------------------------------------------------------------

    def sweep(self) -> list[Failover]:
        """Replace the masters that fell silent (or lost their log), if this meta server holds the
        lease. Returns the failovers made."""
        now = self.clock()
        with self.engine.begin() as conn:
            if not self._take_lease(conn, now):
                return []
            made = []
            for row in conn.execute(sa.select(schema.replication)).all():
                failover = self._check_group(conn, now, row)
                if failover is not None:
                    made.append(failover)
        for f in made:
            log.warning(
                "group %s: failover to %s, epoch %d (log end %d): %s (old master %s)",
                f.group,
                f.master,
                f.epoch,
                f.log_end,
                f.reason,
                f.old_master,
            )
        return made

    def switch(self, group: str, to: str | None = None) -> Failover | None:
        """A manual failover (maintenance): make `to` (default: the in-sync replica with the
        highest log end) the master with the next epoch. None when no replica qualifies."""
        now = self.clock()
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(schema.replication).where(schema.replication.c.group_name == group)).first()
            if row is None:
                return None
            return self._promote(conn, now, row, "manual switch", only=to)

    def listing(self) -> list[dict[str, Any]]:
        """Every replicated group: epoch, master, the replicas last reported in sync, and each
        member's last report: role, epoch, log end and how long ago (META_LIST)."""
        now = self.clock()
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(schema.replication).order_by(schema.replication.c.group_name)).all()
            reports = conn.execute(sa.select(schema.replica).order_by(schema.replica.c.address)).all()
        return [
            {
                "group": r.group_name,
                "epoch": r.epoch,
                "master": r.master,
                "in_sync": list(filter(None, r.in_sync.split(","))),
                "members": [
                    {
                        "address": m.address,
                        "role": m.role,
                        "epoch": m.epoch,
                        "log_end": m.log_end,
                        "reported_s_ago": round((now - as_utc(m.reported_at)).total_seconds(), 3),
                    }
                    for m in reports
                    if m.group_name == r.group_name
                ],
            }
            for r in rows
        ]

    def assignment(self, group: str) -> Assignment | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(schema.replication).where(schema.replication.c.group_name == group)).first()
        return Assignment(group, row.epoch, row.master) if row else None

    def masters(self, conn: Connection) -> dict[str, tuple[str, int]]:
        """group -> (master address, epoch), for the routes."""
        rows = conn.execute(
            sa.select(schema.replication.c.group_name, schema.replication.c.master, schema.replication.c.epoch)
        )
        return {r.group_name: (r.master, r.epoch) for r in rows}

    def _check_group(self, conn: Connection, now: datetime, row) -> Failover | None:
        master = conn.execute(sa.select(schema.replica).where(schema.replica.c.address == row.master)).first()
        if master is not None and master.group_name == row.group_name:
            alive = now - as_utc(master.reported_at) <= self.failover_after
            if alive and self._lost_by_replicas(conn, now, row, master):
                silent = (
                    f"no heartbeat for {self.failover_after_lost.total_seconds():g} s, "
                    "and every in-sync replica lost its connection"
                )
                return self._promote(conn, now, row, f"master gone ({silent})")
            if alive and master.epoch <= row.epoch:
                best = self._best_in_sync(conn, now, row)
                # Only a master report newer than the replica's can show a lost log: a replica's log is
                # a prefix of what the master had when the replica reported. And only from a master that
                # is not serving this epoch: one that is (it reports the role and epoch) has kept its log
                # growing since it took office, and its report was merely made before the replica's and
                # recorded after it (both logs grow while they report).
                newer = as_utc(master.reported_at) >= as_utc(best.reported_at) if best is not None else False
                serving = master.role == "master" and master.epoch == row.epoch
                if best is None or not newer or serving or best.log_end <= master.log_end:
                    self._stuck.discard(row.group_name)
                    return None
                reason = f"the master reports log end {master.log_end}, an in-sync replica has {best.log_end}"
                return self._promote(conn, now, row, reason)
            if alive:
                return None
        silent = "never reported" if master is None else f"no heartbeat for {self.failover_after.total_seconds():g} s"
        return self._promote(conn, now, row, f"master silent ({silent})")

    def _lost_by_replicas(self, conn: Connection, now: datetime, row, master) -> bool:
        """Whether the master is silent for `failover_after_lost` and every live in-sync replica
        (one at least) reported since the master's last report that it cannot reach it."""
        last = as_utc(master.reported_at)
        if now - last <= self.failover_after_lost:
            return False
        live = self._live_in_sync(conn, now, row)
        return bool(live) and all(r.master_lost and as_utc(r.reported_at) > last for r in live)

    def _best_in_sync(self, conn: Connection, now: datetime, row, only: str | None = None):
        """The replica a failover promotes: in sync, heard from within `candidate_within`, the
        longest log."""
        candidates = self._live_in_sync(conn, now, row, only, within=self.candidate_within)
        return max(candidates, key=lambda r: (r.log_end, r.address), default=None)

    def _live_in_sync(
        self, conn: Connection, now: datetime, row, only: str | None = None, within: timedelta | None = None
    ) -> list:
        """The group's replicas the master last listed in sync (or just `only`) that reported within
        `within` (default `failover_after`)."""
        in_sync = set(filter(None, row.in_sync.split(",")))
        if only is not None:
            in_sync &= {only}
        within = self.failover_after if within is None else within
        return [
            r
            for r in conn.execute(sa.select(schema.replica).where(schema.replica.c.group_name == row.group_name)).all()
            if r.address in in_sync and r.address != row.master and now - as_utc(r.reported_at) <= within
        ]

    def _promote(self, conn: Connection, now: datetime, row, reason: str, only: str | None = None) -> Failover | None:
        best = self._best_in_sync(conn, now, row, only)
        if best is None:
            if row.group_name not in self._stuck:
                self._stuck.add(row.group_name)
                log.error("group %s: %s, but no live in-sync replica can take over; waiting", row.group_name, reason)
            return None
        self._stuck.discard(row.group_name)
        result = conn.execute(
            schema.replication.update()
            .where(schema.replication.c.group_name == row.group_name, schema.replication.c.epoch == row.epoch)
            .values(epoch=row.epoch + 1, master=best.address, in_sync="", updated_at=now)
        )
        if result.rowcount != 1:  # another meta server moved first
            return None
        return Failover(row.group_name, row.epoch + 1, best.address, row.master, best.log_end, reason)

    def _take_lease(self, conn: Connection, now: datetime) -> bool:
        """Hold (or renew) the failover lease: true when this meta server may decide now."""
        lease = schema.lease
        held = conn.execute(sa.select(lease.c.holder, lease.c.expires_at).where(lease.c.name == LEASE_NAME)).first()
        renewed_lately = (
            held is not None
            and held.holder == self.holder
            and held.expires_at is not None
            and as_utc(held.expires_at) - now > self.lease_for / 2
        )
        if renewed_lately:
            return True  # no write on every sweep
        result = conn.execute(
            lease.update()
            .where(
                lease.c.name == LEASE_NAME,
                sa.or_(lease.c.holder == self.holder, lease.c.holder.is_(None), lease.c.expires_at < now),
            )
            .values(holder=self.holder, expires_at=now + self.lease_for)
        )
        if result.rowcount == 1:
            return True
        exists = conn.execute(sa.select(lease.c.name).where(lease.c.name == LEASE_NAME)).first()
        if exists is None:
            conn.execute(lease.insert().values(name=LEASE_NAME, holder=self.holder, expires_at=now + self.lease_for))
            return True
        return False
