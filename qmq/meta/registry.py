"""The meta server's state logic over a SQLAlchemy Engine: registration, heartbeats, liveness, read-only
flags and subject routes. No sockets here, so it can be tested and reused (an embedded dev cluster)
on its own; `qmq.meta.server` puts it on the wire.

Liveness: a server is available while its last heartbeat is at most `unavailable_after_s` old (by
the meta server's clock, which also wrote the heartbeat time) and it has not unregistered. A broker
group is available while at least one of its servers is; it is writable when also not read-only.

Routes only grow. A producer's request (create=True) makes sure the subject has `route_groups`
writable groups: when it has fewer (a new subject, too few groups existed when it was created, or
some of its groups became unavailable or read-only), writable groups it does not have yet are added,
those carrying the fewest subjects first (ties by name). Groups are never taken off a route, so
consumers, who ask with create=False, always get every group that may still hold the subject's
messages and can drain them.

All methods are blocking (database round trips): call them off the event loop. Database errors
(sqlalchemy.exc.OperationalError and friends) propagate; the caller decides what to answer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qmq.meta import schema
from qmq.meta.schema import as_utc
from qmq.protocol.limits import DELAY_GROUP_PREFIX

HEARTBEAT_INTERVAL_S = 10  # how often brokers and delay servers are asked to heartbeat
UNAVAILABLE_AFTER_S = 30  # a server silent for longer than this is unavailable
DEFAULT_ROUTE_GROUPS = 2  # writable broker groups a producer's subject is kept on
WRITE_ATTEMPTS = 3  # a write that lost a race with another meta server (unique key) is retried
# A route look-up reuses the servers and groups read this recently (this registry's own writes make it
# read them again at once): during a failover every producer asks again, up to once a second each
# while its send waits (docs/client.md), and a read of them costs 5 queries. Other writes (another
# meta server's, the failover decisions of qmq.meta.election) and a heartbeat's age show this much
# later at most; clients cache routes for 30 s anyway.
ROUTE_STATE_TTL_S = 0.1

Kind = Literal["broker", "delay"]
T = TypeVar("T")


def utc_now() -> datetime:
    return datetime.now(UTC)


class UnknownGroup(LookupError):
    """The request names a broker group that never registered."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown broker group {name!r}: no broker of that group has registered")
        self.name = name


@dataclass(frozen=True)
class ServerState:
    address: str
    kind: str
    group: str | None
    available: bool
    registered_at: datetime
    last_heartbeat_at: datetime
    unregistered_at: datetime | None
    external_address: str | None = None  # for clients outside the servers' network
    serves: bool = True  # takes client requests: not a replica of a replicated delay-server group
    epoch: int = 0  # the epoch of the replicated delay-server group it is master of

    @property
    def outside_address(self) -> str:
        return self.external_address or self.address

    def to_wire(self, now: datetime) -> dict[str, Any]:
        return {
            "address": self.address,
            "external_address": self.outside_address,
            "kind": self.kind,
            "group": self.group,
            "available": self.available,
            "serves": self.serves,
            "registered_at": self.registered_at.isoformat(),
            "last_heartbeat_at": self.last_heartbeat_at.isoformat(),
            "heartbeat_age_s": round((now - self.last_heartbeat_at).total_seconds(), 3),
            "unregistered_at": self.unregistered_at.isoformat() if self.unregistered_at else None,
        }


@dataclass(frozen=True)
class GroupState:
    name: str
    read_only: bool
    available: bool
    addresses: tuple[str, ...]  # live servers; every known server when none is live
    subjects: int  # how many subjects are routed to the group
    external_addresses: tuple[str, ...] = ()  # the same servers, for clients outside their network
    master: str | None = None  # a replicated group's master (listed first in `addresses` while live)
    epoch: int = 0  # a replicated group's epoch (qmq.meta.election)

    @property
    def writable(self) -> bool:
        return self.available and not self.read_only

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "name": self.name,
            "addresses": list(self.addresses),
            "external_addresses": list(self.external_addresses),
            "available": self.available,
            "read_only": self.read_only,
        }
        if self.master is not None:
            wire |= {"master": self.master, "epoch": self.epoch}
        return wire


@dataclass(frozen=True)
class Registration:
    """The outcome of a heartbeat. `event` says what changed, for the log: "registered" (a server
    never seen before), "available again" (after silence or unregistering), "moved" (a new group or
    kind for a known address) or None (a routine heartbeat)."""

    address: str
    kind: str
    group: str | None
    read_only: bool
    event: str | None
    group_created: bool


@dataclass(frozen=True)
class Route:
    subject: str
    groups: tuple[GroupState, ...]  # in the order they were given to the subject
    delay_servers: tuple[ServerState, ...]
    added: tuple[str, ...] = field(default=())  # groups this request added to the route

    def to_wire(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "groups": [g.to_wire() for g in self.groups],
            "delay_servers": [
                {"address": s.address, "external_address": s.outside_address, "available": s.available}
                | ({"epoch": s.epoch} if s.epoch else {})
                for s in self.delay_servers
            ],
        }


@dataclass(frozen=True)
class _RouteRead:
    """What one read of a subject's route found: every group, the route's group names, the delay servers."""

    subject: str
    groups_by_name: dict[str, GroupState]
    names: list[str]
    delay_servers: tuple[ServerState, ...]

    def answer(self, added: tuple[str, ...]) -> Route:
        groups = tuple(self.groups_by_name[n] for n in self.names if n in self.groups_by_name)
        return Route(self.subject, groups, self.delay_servers, added)


class Registry:
    """The meta state in the tables of qmq.meta.schema. Thread-safe; several meta servers may share
    one database (a write that races another is retried)."""

    def __init__(
        self,
        engine: Engine,
        *,
        unavailable_after_s: float = UNAVAILABLE_AFTER_S,
        route_groups: int = DEFAULT_ROUTE_GROUPS,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        """`clock` returns the current time as an aware datetime; tests may pass their own."""
        if unavailable_after_s <= 0:
            raise ValueError("unavailable_after_s must be positive")
        if route_groups < 1:
            raise ValueError("route_groups must be at least 1")
        self.engine = engine
        self.unavailable_after = timedelta(seconds=unavailable_after_s)
        self.route_groups = route_groups
        self.clock = clock
        self._route_lock = threading.Lock()  # one route extension at a time in this process
        # (the clock when read, servers, groups without their subject counts) for route look-ups
        self._route_state: tuple[datetime, list[ServerState], dict[str, GroupState]] | None = None
        self._writes = 0  # write transactions ended: a read that overlapped one is not kept
        self._route_state_ttl = timedelta(seconds=ROUTE_STATE_TTL_S)

    # -- writes ---------------------------------------------------------------------------------

    def heartbeat(
        self, address: str, kind: Kind, group: str | None, external_address: str | None = None
    ) -> Registration:
        """Record a registration or heartbeat of the server at `address` (a heartbeat from an unknown
        server registers it). Brokers name their `group`, which is created on first sight; delay
        servers belong to no group. `external_address` is where clients outside the servers' network
        reach it (None: at `address`); each heartbeat sets it anew."""
        if kind == "broker" and not group:
            raise ValueError("a broker must name its group")
        group = group if kind == "broker" else None
        now = self.clock()

        def write(conn: Connection) -> Registration:
            read_only, group_created = False, False
            if group is not None:
                row = conn.execute(sa.select(schema.group.c.read_only).where(schema.group.c.name == group)).first()
                if row is None:
                    conn.execute(
                        schema.group.insert().values(name=group, read_only=False, created_at=now, updated_at=now)
                    )
                    group_created = True
                else:
                    read_only = bool(row.read_only)
            # What every registration and heartbeat sets.
            seen = {"external_address": external_address, "kind": kind, "group_name": group, "last_heartbeat_at": now}
            old = conn.execute(sa.select(schema.server).where(schema.server.c.address == address)).first()
            if old is None:
                conn.execute(schema.server.insert().values(address=address, registered_at=now, **seen))
                event: str | None = "registered"
            else:
                if (old.kind, old.group_name) != (kind, group):
                    event = "moved"
                elif not self._alive(old, now):
                    event = "available again"
                else:
                    event = None
                values: dict[str, Any] = {**seen, "unregistered_at": None}
                if event is not None:
                    values["registered_at"] = now
                conn.execute(schema.server.update().where(schema.server.c.address == address).values(**values))
            return Registration(address, kind, group, read_only, event, group_created)

        return self._write(write)

    def unregister(self, address: str) -> bool:
        """A clean shutdown: the server is unavailable at once (its next heartbeat brings it back).
        Returns False for an address never registered."""
        now = self.clock()
        with self._changing(), self.engine.begin() as conn:
            result = conn.execute(
                schema.server.update().where(schema.server.c.address == address).values(unregistered_at=now)
            )
            return result.rowcount > 0

    def internal_address(self, address: str) -> str:
        """The server's own address for `address`, which may be the one it advertises for outside
        clients (`--advertise-external`); `address` itself when no server advertises it."""
        with self.engine.connect() as conn:
            found = conn.execute(
                sa.select(schema.server.c.address).where(schema.server.c.external_address == address)
            ).first()
        return found.address if found is not None else address

    def remove(self, address: str) -> bool:
        """A server gone for good (`qmq admin group forget`): no longer listed at all. Its next
        heartbeat, should it ever come back, registers it again. Returns False for an unknown one."""
        with self._changing(), self.engine.begin() as conn:
            return conn.execute(schema.server.delete().where(schema.server.c.address == address)).rowcount > 0

    def set_read_only(self, group: str, read_only: bool) -> bool:
        """Set a group's read-only flag; returns whether it changed. Raises UnknownGroup."""
        now = self.clock()
        with self._changing(), self.engine.begin() as conn:
            row = conn.execute(sa.select(schema.group.c.read_only).where(schema.group.c.name == group)).first()
            if row is None:
                raise UnknownGroup(group)
            if bool(row.read_only) == read_only:
                return False
            conn.execute(
                schema.group.update().where(schema.group.c.name == group).values(read_only=read_only, updated_at=now)
            )
            return True

    def route(self, subject: str, *, create: bool) -> Route:
        """The subject's route. With `create` (producers) it is first topped up to `route_groups`
        writable groups when it has fewer and enough exist (see the module docstring)."""
        route = self._read_route(subject)
        if not create or not self._to_add(route.groups_by_name, route.names):
            return route.answer(())  # the common case: a read, no lock, no write
        with self._route_lock:
            added = self._write(lambda conn: self._extend_route(conn, subject, self.clock()))
        return self._read_route(subject).answer(added)

    def _read_route(self, subject: str) -> _RouteRead:
        now = self.clock()
        with self.engine.connect() as conn:
            state = self._route_state
            if state is None or not timedelta(0) <= now - state[0] < self._route_state_ttl:
                writes = self._writes
                servers = self._servers(conn, now)
                state = (now, servers, self._groups(conn, now, servers, counts=False))
                if writes == self._writes:
                    self._route_state = state
            _, servers, groups = state
            names = self._route_names(conn, subject)
        delay = tuple(s for s in servers if s.kind == "delay" and s.serves)
        return _RouteRead(subject, groups, names, delay)

    # -- reads ----------------------------------------------------------------------------------

    def servers(self) -> list[ServerState]:
        """Every server ever registered, by address."""
        now = self.clock()
        with self.engine.connect() as conn:
            return self._servers(conn, now)

    def groups(self) -> list[GroupState]:
        """Every broker group, by name."""
        now = self.clock()
        with self.engine.connect() as conn:
            return list(self._groups(conn, now).values())

    def snapshot(self) -> dict[str, Any]:
        """Everything, for META_LIST (admins, tests): groups, servers and routes, plus the timing."""
        now = self.clock()
        with self.engine.connect() as conn:
            servers = self._servers(conn, now)
            groups = self._groups(conn, now, servers)
            rows = conn.execute(
                sa.select(schema.route.c.subject, schema.route.c.group_name).order_by(
                    schema.route.c.subject, schema.route.c.position
                )
            ).all()
        routes: dict[str, list[str]] = {}
        for row in rows:
            routes.setdefault(row.subject, []).append(row.group_name)
        return {
            "now": now.isoformat(),
            "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
            "unavailable_after_s": self.unavailable_after.total_seconds(),
            "route_groups": self.route_groups,
            "groups": [{**g.to_wire(), "subjects": g.subjects} for g in groups.values()],
            "servers": [s.to_wire(now) for s in servers],
            "routes": [{"subject": subject, "groups": names} for subject, names in routes.items()],
        }

    # -- internals ------------------------------------------------------------------------------

    def _alive(self, row: Any, now: datetime) -> bool:
        if row.unregistered_at is not None:
            return False
        # A heartbeat time in the future (another meta server's clock is ahead) counts as fresh.
        return now - as_utc(row.last_heartbeat_at) <= self.unavailable_after

    def _write(self, fn: Callable[[Connection], T]) -> T:
        """Run `fn` in a transaction; retry when it lost an insert race to another process."""
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with self._changing(), self.engine.begin() as conn:
                    return fn(conn)
            except sa.exc.IntegrityError:
                if attempt == WRITE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Around a write transaction: route look-ups read the servers and groups again once it
        ended (committed or not), not from before it."""
        try:
            yield
        finally:
            self._writes += 1
            self._route_state = None

    def _servers(self, conn: Connection, now: datetime) -> list[ServerState]:
        rows = conn.execute(sa.select(schema.server).order_by(schema.server.c.address)).all()
        replicas, epochs = self._delay_roles(conn)
        return [
            ServerState(
                address=row.address,
                kind=row.kind,
                group=row.group_name,
                available=self._alive(row, now),
                registered_at=as_utc(row.registered_at),
                last_heartbeat_at=as_utc(row.last_heartbeat_at),
                unregistered_at=as_utc(row.unregistered_at) if row.unregistered_at is not None else None,
                external_address=row.external_address,
                serves=row.address not in replicas,
                epoch=epochs.get(row.address, 0),
            )
            for row in rows
        ]

    def _delay_roles(self, conn: Connection) -> tuple[set[str], dict[str, int]]:
        """Delay servers that are replicas in a replicated group (qmq.meta.election keys those groups
        `delay:NAME`): they answer NOT_MASTER, so routes leave them out; the master stays in, with
        its group's epoch (given to clients, which name it in their requests)."""
        delay_groups = schema.replication.c.group_name.like(f"{DELAY_GROUP_PREFIX}%")
        rows = conn.execute(
            sa.select(schema.replication.c.group_name, schema.replication.c.master, schema.replication.c.epoch).where(
                delay_groups
            )
        ).all()
        masters = {r.group_name: r.master for r in rows}
        members = conn.execute(
            sa.select(schema.replica.c.address, schema.replica.c.group_name).where(
                schema.replica.c.group_name.like(f"{DELAY_GROUP_PREFIX}%")
            )
        )
        replicas = {r.address for r in members if masters.get(r.group_name) != r.address}
        return replicas, {r.master: r.epoch for r in rows}

    def _groups(
        self, conn: Connection, now: datetime, servers: list[ServerState] | None = None, *, counts: bool = True
    ) -> dict[str, GroupState]:
        """Every broker group; `servers` when the caller has read them already (in this transaction).
        `counts=False`: each group's `subjects` left at 0, unread (a count over every route row)."""
        servers = [s for s in (servers if servers is not None else self._servers(conn, now)) if s.kind == "broker"]
        subjects: dict[str, int] = {}
        if counts:
            subjects = dict(
                conn.execute(
                    sa.select(schema.route.c.group_name, sa.func.count()).group_by(schema.route.c.group_name)
                ).all()
            )
        masters = {
            r.group_name: (r.master, r.epoch)
            for r in conn.execute(
                sa.select(schema.replication.c.group_name, schema.replication.c.master, schema.replication.c.epoch)
            )
        }
        result: dict[str, GroupState] = {}
        for row in conn.execute(sa.select(schema.group).order_by(schema.group.c.name)).all():
            master, epoch = masters.get(row.name, (None, 0))
            members = sorted((s for s in servers if s.group == row.name), key=lambda s: s.address != master)
            live = [s for s in members if s.available]
            listed = live or members
            result[row.name] = GroupState(
                name=row.name,
                read_only=bool(row.read_only),
                available=bool(live),
                addresses=tuple(s.address for s in listed),
                subjects=int(subjects.get(row.name, 0)),
                external_addresses=tuple(s.outside_address for s in listed),
                master=master,
                epoch=epoch,
            )
        return result

    def _route_names(self, conn: Connection, subject: str) -> list[str]:
        return list(
            conn.execute(
                sa.select(schema.route.c.group_name)
                .where(schema.route.c.subject == subject)
                .order_by(schema.route.c.position, schema.route.c.group_name)
            ).scalars()
        )

    def _to_add(self, groups: dict[str, GroupState], current: list[str]) -> list[GroupState]:
        """The writable groups a route of `current` groups gets to have `route_groups` writable ones:
        the least loaded first; none when it has enough or no other writable group exists."""
        missing = self.route_groups - sum(1 for n in current if n in groups and groups[n].writable)
        if missing <= 0:
            return []
        others = (g for g in groups.values() if g.writable and g.name not in current)
        return sorted(others, key=lambda g: (g.subjects, g.name))[:missing]

    def _extend_route(self, conn: Connection, subject: str, now: datetime) -> tuple[str, ...]:
        current = self._route_names(conn, subject)
        candidates = self._to_add(self._groups(conn, now), current)
        if not candidates:
            return ()
        position = conn.execute(
            sa.select(sa.func.coalesce(sa.func.max(schema.route.c.position) + 1, 0)).where(
                schema.route.c.subject == subject
            )
        ).scalar_one()
        conn.execute(
            schema.route.insert(),
            [
                {"subject": subject, "group_name": g.name, "position": position + i, "created_at": now}
                for i, g in enumerate(candidates)
            ],
        )
        return tuple(g.name for g in candidates)
