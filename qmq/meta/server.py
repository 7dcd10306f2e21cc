"""The meta server on the wire: the request handler over a `Registry`, a liveness sweep that logs
servers and groups going unavailable, Prometheus metrics, and `run()`, the `qmq meta` process.

Promises: a request body that is missing a field or has a bad one gets a BAD_REQUEST (or
BAD_SUBJECT) error frame and the connection stays usable; a database that cannot be reached gets an
UNAVAILABLE error frame naming the cause, and the server serves again as soon as the database is
back; SIGTERM (or SIGINT) closes the server and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from prometheus_client import Gauge

from qmq import metrics
from qmq.db.engine import create_engine, safe_url
from qmq.db.migrate import upgrade
from qmq.meta import ordering
from qmq.meta.credentials import CredentialStore, LocalAuthenticator, credential_handlers
from qmq.meta.election import FAILOVER_AFTER_S, Election, ForgetRefused, heartbeat_interval_s
from qmq.meta.listeners import external_view, internal_view, viewed
from qmq.meta.registry import (
    HEARTBEAT_INTERVAL_S,
    UNAVAILABLE_AFTER_S,
    Kind,
    Registry,
    UnknownGroup,
)
from qmq.meta.schema import ADDRESS_LEN, KINDS
from qmq.net.server import Server, run_process, stop_on_signals
from qmq.net.service import Service
from qmq.protocol.codes import RequestCode
from qmq.protocol.fields import bad, choice_field, field
from qmq.protocol.limits import DELAY_GROUP_PREFIX, validate_group, validate_subject
from qmq.protocol.ordering import split_queue_subject

log = logging.getLogger("qmq.meta")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 20880
MAX_SWEEP_INTERVAL_S = 1.0
FAILOVER_SWEEP_S = 0.25  # silent masters are looked for this often (a read, and the lease renewal)
ROLES = ("master", "replica", "pending")  # the liveness sweep runs at least this often (more often for short timeouts)

T = TypeVar("T")

REGISTRY = metrics.new_registry()
REQUESTS = metrics.RequestMetrics("qmq_meta", "meta server", REGISTRY)
SERVERS = Gauge("qmq_meta_servers", "Registered servers", ["kind", "state"], registry=REGISTRY)
GROUPS = Gauge("qmq_meta_groups", "Broker groups", ["state"], registry=REGISTRY)
ROUTES = Gauge("qmq_meta_route_groups", "Subject-to-group route entries", registry=REGISTRY)
DB_UP = Gauge(
    "qmq_meta_database_up",
    "1 while the meta database answers, 0 after an error reaching it",
    registry=REGISTRY,
)

# Errors that mean "the database is not reachable right now", as opposed to a bug in a query.
_DB_DOWN_ERRORS = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)


def _address(value: object) -> str:
    """A server's `host:port`, as clients will connect to it."""
    if not isinstance(value, str) or not value:
        raise bad("field 'address' must be a non-empty 'host:port' string")
    host, _, port = value.rpartition(":")
    if len(value) > ADDRESS_LEN or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise bad(f"address {value!r} is not 'host:port' with a port from 1 to 65535")
    return value


def _replicated_group(body: dict[str, Any]) -> str:
    """The body's replicated group: a broker group's name, or `delay:NAME` for a delay-server group
    (as META_LIST lists it)."""
    group = field(body, "group", str)
    validate_group(group.removeprefix(DELAY_GROUP_PREFIX))
    return group


class MetaService(Service):
    """The request handler (`handle`) and the liveness sweep (`sweep_forever`) over one Registry."""

    name = "meta server"
    log = log
    storage = "database"
    storage_errors = _DB_DOWN_ERRORS

    def __init__(self, registry: Registry, election: Election | None = None) -> None:
        super().__init__(REQUESTS)
        self.registry = registry
        self.election = election or Election(registry.engine, clock=registry.clock)
        self._db_ok = True
        self._live_servers: set[str] | None = None  # None until the first sweep
        self._live_groups: set[str] | None = None
        self.credentials = CredentialStore(registry.engine)
        self.handlers |= credential_handlers(self.credentials, self._db)
        self.handlers |= {
            RequestCode.META_REGISTER: self._register,
            RequestCode.META_HEARTBEAT: self._register,
            RequestCode.META_UNREGISTER: self._unregister,
            RequestCode.META_ROUTE: self._route,
            RequestCode.META_SET_READ_ONLY: self._set_read_only,
            RequestCode.META_LIST: self._list,
            RequestCode.REPL_SWITCH: self._switch,
            RequestCode.REPL_FORGET: self._forget,
        }

    # -- requests -------------------------------------------------------------------------------

    async def _register(self, body: dict[str, Any]) -> dict[str, Any]:
        kind = choice_field(body, "kind", KINDS)
        address = _address(body.get("address"))
        external = _address(body["external_address"]) if body.get("external_address") is not None else None
        group = validate_group(field(body, "group", str)) if kind == "broker" else None
        reg = await self._db(self.registry.heartbeat, address, _kind(kind), group, external)
        if reg.group_created:
            log.info("group %s created", reg.group)
        if reg.event is not None:
            where = f" in group {reg.group}" if reg.group else ""
            log.info("%s %s%s %s", reg.kind, reg.address, where, reg.event)
        if self._live_servers is not None:
            self._live_servers.add(address)
        reply: dict[str, Any] = {"heartbeat_interval_s": HEARTBEAT_INTERVAL_S, "read_only": reg.read_only}
        if body.get("role") is not None:  # a server of a replicated group (docs/replication.md)
            reply |= await self._replication_report(kind, address, body)
        return reply

    async def _replication_report(self, kind: str, address: str, body: dict[str, Any]) -> dict[str, Any]:
        group = validate_group(field(body, "group", str))
        role = choice_field(body, "role", ROLES)
        epoch = field(body, "epoch", int, 0)
        log_end = field(body, "log_end", int, 0)
        in_sync = body.get("in_sync")
        if in_sync is not None and not (isinstance(in_sync, list) and all(isinstance(a, str) for a in in_sync)):
            raise bad("field 'in_sync' must be a list of addresses")
        key = group if kind == "broker" else f"{DELAY_GROUP_PREFIX}{group}"
        master_lost = field(body, "master_lost", bool, False)  # a replica cannot reach its master
        assigned = await self._db(self.election.report, address, key, role, epoch, log_end, in_sync, master_lost)
        failover_after_s = self.election.failover_after.total_seconds()
        return {
            "role": assigned.role_of(address),
            "epoch": assigned.epoch,
            "master": assigned.master,
            "members": assigned.members,
            "peers": list(assigned.peers),
            "failover_after_s": failover_after_s,
            "heartbeat_interval_s": heartbeat_interval_s(failover_after_s),
        }

    async def _unregister(self, body: dict[str, Any]) -> dict[str, Any]:
        address = _address(body.get("address"))
        known = await self._db(self.registry.unregister, address)
        await self._db(self.election.forget, address)
        if known:
            log.info("server %s unregistered (clean shutdown): unavailable", address)
            if self._live_servers is not None:
                self._live_servers.discard(address)
        return {"unregistered": known}

    async def _route(self, body: dict[str, Any]) -> dict[str, Any]:
        subject = validate_subject(field(body, "subject", str))
        create = field(body, "create", bool, False)
        if split_queue_subject(subject) is not None:  # one queue of an ordered subject: its one group
            return (await self._db(ordering.queue_route, self.registry, subject)).to_wire()
        route = await self._db(self.registry.route, subject, create=create)
        if route.added:
            all_groups = [g.name for g in route.groups]
            how = "created" if len(all_groups) == len(route.added) else "extended"
            log.info("route %s %s: groups %s (added %s)", subject, how, ", ".join(all_groups), ", ".join(route.added))
        return route.to_wire()

    async def _set_read_only(self, body: dict[str, Any]) -> dict[str, Any]:
        group = validate_group(field(body, "group", str))
        read_only = field(body, "read_only", bool)
        try:
            changed = await self._db(self.registry.set_read_only, group, read_only)
        except UnknownGroup as exc:
            raise bad(str(exc)) from None
        if changed:
            log.info("group %s is now %s", group, "read-only" if read_only else "writable")
        return {"group": group, "read_only": read_only, "changed": changed}

    async def _switch(self, body: dict[str, Any]) -> dict[str, Any]:
        """REPL_SWITCH (`qmq admin failover`): make `to` (an in-sync replica) master, next epoch. A
        delay-server group is named `delay:NAME`, as META_LIST lists it."""
        group = _replicated_group(body)
        to = _address(body["to"]) if body.get("to") is not None else None
        switched = await self._db(self.election.switch, group, to)
        if switched is None:
            raise bad(f"group {group!r}: no live in-sync replica{f' {to}' if to else ''} to switch to")
        log.warning("group %s: manual switch to %s, epoch %d", group, switched.master, switched.epoch)
        return {"group": group, "epoch": switched.epoch, "master": switched.master}

    async def _forget(self, body: dict[str, Any]) -> dict[str, Any]:
        """REPL_FORGET (`qmq admin group forget`): remove a member gone for good from a broker group
        or a delay-server group (`delay:NAME`)."""
        group = _replicated_group(body)
        address = await self._db(self.registry.internal_address, _address(body.get("address")))
        force = field(body, "force", bool, False)
        try:
            forgotten = await self._db(self.election.forget_member, group, address, force=force)
        except ForgetRefused as exc:
            raise bad(str(exc)) from None
        await self._db(self.registry.remove, address)
        if self._live_servers is not None:
            self._live_servers.discard(address)
        return {
            "group": group,
            "forgotten": address,
            "silent_s": round(forgotten.silent_s, 3),
            "epoch": forgotten.epoch,
            "master": forgotten.master,
            "replicas": list(forgotten.replicas),
        }

    async def _list(self, body: dict[str, Any]) -> dict[str, Any]:
        snapshot = await self._db(self.registry.snapshot)
        snapshot["replication"] = await self._db(self.election.listing)
        return snapshot

    # -- database access ------------------------------------------------------------------------

    async def _db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking registry call in a worker thread. A database that cannot be reached raises
        one of `storage_errors`: the request is answered UNAVAILABLE (`Service`)."""
        result = await asyncio.to_thread(fn, *args, **kwargs)
        self._db_up()
        return result

    def storage_failed(self, exc: BaseException) -> str:
        """The database cannot be reached: the gauge goes to 0, a line is logged once per outage."""
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        DB_UP.set(0)
        if self._db_ok:
            self._db_ok = False
            log.error("database unavailable: %s", cause)
        return cause

    def _db_up(self) -> None:
        DB_UP.set(1)
        if not self._db_ok:
            self._db_ok = True
            log.info("database reachable again")

    # -- liveness sweep -------------------------------------------------------------------------

    async def sweep_forever(self, interval_s: float) -> None:
        """Every `interval_s`: log servers and groups that became unavailable (or groups available
        again) and refresh the gauges. Replies never wait for this: they compute liveness themselves."""
        while True:
            await self.sweep()
            await asyncio.sleep(interval_s)  # a period, not a wait for an event

    async def sweep(self) -> None:
        try:
            servers, groups, route_entries = await self._db(self._read_state)
        except _DB_DOWN_ERRORS as exc:  # try again next time
            self.storage_failed(exc)
            return
        except Exception:
            log.exception("liveness sweep failed")
            return
        live_servers = {s.address for s in servers if s.available}
        live_groups = {g.name for g in groups if g.available}
        if self._live_servers is not None and self._live_groups is not None:
            for s in servers:
                if s.address in self._live_servers and not s.available:
                    timeout_s = self.registry.unavailable_after.total_seconds()
                    why = "unregistered" if s.unregistered_at else f"no heartbeat for {timeout_s:g} s"
                    where = f" in group {s.group}" if s.group else ""
                    log.warning("%s %s%s became unavailable: %s", s.kind, s.address, where, why)
            for g in groups:
                if g.name in self._live_groups and not g.available:
                    log.warning("group %s became unavailable: none of its servers is alive", g.name)
                elif g.name not in self._live_groups and g.available:
                    log.info("group %s is available", g.name)
        self._live_servers, self._live_groups = live_servers, live_groups
        for kind in KINDS:
            SERVERS.labels(kind, "available").set(sum(1 for s in servers if s.kind == kind and s.available))
            SERVERS.labels(kind, "unavailable").set(sum(1 for s in servers if s.kind == kind and not s.available))
        GROUPS.labels("writable").set(sum(1 for g in groups if g.writable))
        GROUPS.labels("read_only").set(sum(1 for g in groups if g.available and g.read_only))
        GROUPS.labels("unavailable").set(sum(1 for g in groups if not g.available))
        ROUTES.set(route_entries)

    async def failover_forever(self, interval_s: float) -> None:
        """Every `interval_s`: replace silent masters (qmq.meta.election), when this meta server
        holds the failover lease."""
        while True:
            try:
                await self._db(self.election.sweep)
            except _DB_DOWN_ERRORS as exc:
                self.storage_failed(exc)
            except Exception:
                log.exception("failover sweep failed")
            await asyncio.sleep(interval_s)  # a period, not a wait for an event

    def _read_state(self) -> tuple[list, list, int]:
        groups = self.registry.groups()
        return self.registry.servers(), groups, sum(g.subjects for g in groups)


def _kind(value: str) -> Kind:
    return "broker" if value == "broker" else "delay"


async def serve_meta(
    db_url: str,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    external_port: int | None = None,
    token: str | None = None,
    heartbeat_timeout_s: float = UNAVAILABLE_AFTER_S,
    failover_after_s: float = FAILOVER_AFTER_S,
    metrics_port: int | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Migrate the database, serve until `stop` is set (or SIGTERM/SIGINT when `stop` is None), then
    close every connection and the engine. With `external_port`, a second listener on `host` serves
    clients outside the servers' network (qmq.meta.listeners)."""
    revision = await asyncio.to_thread(upgrade, db_url)
    engine = create_engine(db_url)
    log.info("database %s at revision %s", safe_url(engine), revision)
    registry = Registry(engine, unavailable_after_s=heartbeat_timeout_s)
    service = MetaService(registry, Election(engine, failover_after_s=failover_after_s, clock=registry.clock))
    if stop is None:
        stop = stop_on_signals()
    if metrics_port is not None:
        metrics_port = metrics.serve(REGISTRY, host, metrics_port)
        log.info("metrics on http://%s:%d/metrics", host, metrics_port)
    authenticator = LocalAuthenticator(service.credentials)
    server = Server(
        viewed(service.handle, internal_view), host=host, port=port, token=token, authenticator=authenticator
    )
    await server.start()
    servers = [server]
    if external_port is not None:
        external = Server(
            viewed(service.handle, external_view),
            host=host,
            port=external_port,
            token=token,
            authenticator=authenticator,
        )
        servers.append(external)
        await servers[-1].start()
        log.info("external listener on %s:%d (replies name external addresses)", host, servers[-1].port)
    log.info(
        "meta server ready on %s:%d (heartbeat every %d s, unavailable after %g s)",
        host,
        server.port,
        HEARTBEAT_INTERVAL_S,
        heartbeat_timeout_s,
    )
    sweeper = asyncio.create_task(service.sweep_forever(min(MAX_SWEEP_INTERVAL_S, heartbeat_timeout_s / 4)))
    failovers = asyncio.create_task(service.failover_forever(min(FAILOVER_SWEEP_S, failover_after_s / 8)))
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        for task in (sweeper, failovers):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for listener in servers:
            await listener.close()
        await asyncio.to_thread(engine.dispose)
    log.info("meta server stopped")


def run(db_url: str, **kwargs: Any) -> None:
    """The `qmq meta` process: `serve_meta` on uvloop when it is installed."""
    run_process(serve_meta(db_url, **kwargs))
